//! The `#[idempotent]` attribute for `inbox-runtime`.
//!
//! Depend on `inbox-runtime`, which re-exports this macro; this crate only parses, validates and
//! expands. All behaviour lives in `inbox_runtime::__private`, which the expansion calls by absolute
//! path.

mod args;
mod expand;
mod validate;

use proc_macro::TokenStream;

/// Turns an `async fn` into an idempotent message handler: see `inbox_runtime::idempotent`.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    let fallback = match syn::parse::<syn::ItemFn>(item.clone()) {
        Ok(mut func) => {
            expand::explicit_mut_ref_lifetimes(&mut func);
            quote::quote!(#func)
        }
        Err(_) => proc_macro2::TokenStream::from(item.clone()),
    };
    let result = syn::parse::<args::Args>(attr).and_then(|args| {
        let func = syn::parse::<syn::ItemFn>(item)?;
        let ir = validate::validate(args, func)?;
        Ok(expand::expand(&ir))
    });
    match result {
        Ok(tokens) => tokens.into(),
        // Like tokio-macros: hand the item back next to the error so that the user sees one error,
        // not a cascade of "cannot find function" errors, and IDEs keep working.
        Err(err) => {
            let mut out = err.to_compile_error();
            out.extend(fallback);
            out.into()
        }
    }
}
