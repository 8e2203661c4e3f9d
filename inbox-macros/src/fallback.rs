//! What `#[idempotent]` emits for a handler with mistakes: the errors, and beside them as much of
//! the real expansion as the signature allows, so that each mistake is reported once. Without the
//! unit struct every use of the handler (`.build(credit)`, `inbox.process(&credit, ..)`) would add
//! an error of its own.

use crate::expand::{
    ImplTypes, codec_of, explicit_mut_ref_lifetimes, handler_impl, returns_unit_check, unit_struct,
};
use crate::validate::{Invalid, Types};
use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

/// The compile errors, the unit struct, a stub `Handler` impl when the types are known, and the
/// user's function, type-checked on its own.
pub fn expand(invalid: &Invalid) -> TokenStream {
    let errors = invalid.error.to_compile_error();
    let mut func = invalid.func.clone();
    explicit_mut_ref_lifetimes(&mut func);
    let name = &func.sig.ident;
    let unit = unit_struct(&func, invalid.consumer.as_ref());
    let stub = invalid
        .types
        .as_ref()
        .map(|types| stub_impl(name, invalid, types));
    // The function, exactly as declared, stays in the build so that its body is still checked and
    // the imports it uses stay used. Nested in an anonymous const because the unit struct takes
    // its name. Nothing calls it, and a generic one cannot even be named without its parameters,
    // so its dead-code warning is silenced instead.
    let body = invalid.keep_body.then(|| {
        quote! {
            const _: () = {
                #[allow(dead_code)]
                #func
            };
        }
    });
    quote! {
        #errors
        #unit
        #stub
        #body
    }
}

/// A `Handler` impl whose methods never run (the crate does not compile), so that the handler can
/// be passed wherever one is expected without a second error.
fn stub_impl(name: &syn::Ident, invalid: &Invalid, types: &Types) -> TokenStream {
    let rt = quote!(::inbox_runtime::__private);
    let db = &types.db;
    let msg_ty = &types.message;
    let state_ty = match &types.state {
        Some(ty) => quote!(#ty),
        None => quote!(()),
    };
    // A `Result` return type is used as declared and checked, so that a wrong `Result<u32, E>`
    // is still reported (on the user's type) next to the other mistakes; any other return type
    // was already reported by validation, and the boxed error stands in for it.
    let (error_ty, returns_unit) = match &types.ret {
        Some(ret) => (
            quote_spanned! {ret.span()=> <#ret as #rt::HandlerResult>::Error },
            returns_unit_check(ret),
        ),
        None => (quote!(::inbox_runtime::BoxError), TokenStream::new()),
    };
    let consumer = match &invalid.consumer {
        Some(lit) => quote!(#lit),
        None => quote!(""),
    };
    let types = ImplTypes {
        db: quote!(#db),
        message: quote!(#msg_ty),
        state: state_ty,
        error: error_ty,
        consumer,
        codec: codec_of(types.codec.as_ref()),
    };
    let key_body = quote!(::core::result::Result::Ok(::core::option::Option::None));
    let handle_body = quote! {
        #returns_unit
        async { ::core::unreachable!() }
    };
    handler_impl(name, &types, key_body, handle_body, TokenStream::new())
}
