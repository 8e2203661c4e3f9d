//! The `#[idempotent]` attribute for `inbox-runtime`.
//!
//! Depend on `inbox-runtime`, which re-exports this macro; this crate only parses, validates and
//! expands. All behaviour lives in `inbox_runtime::__private`, which the expansion calls by absolute
//! path.

mod args;
mod expand;
mod fallback;
mod validate;

use proc_macro::TokenStream;

/// Turns an `async fn` into an idempotent message handler: see `inbox_runtime::idempotent`.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    let args = syn::parse::<args::Args>(attr);
    let func = match syn::parse::<syn::ItemFn>(item.clone()) {
        Ok(func) => func,
        // Not a function: there is no handler to stand in for, so the item goes back unchanged
        // beside the error, as tokio-macros does, and the rest of the crate still resolves.
        Err(err) => {
            let mut out = TokenStream::from(err.to_compile_error());
            out.extend(item);
            return out;
        }
    };
    match validate::validate(args, func) {
        Ok(handler) => expand::expand(&handler),
        Err(invalid) => fallback::expand(&invalid),
    }
    .into()
}
