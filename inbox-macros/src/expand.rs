//! Code generation: a unit struct named after the function that implements
//! `inbox_runtime::Handler`, with the user's function moved, unchanged, inside.

use crate::validate::Handler;
use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, GenericArgument, ItemFn, LitStr, PathArguments, Type, parse_quote};

/// The unit struct and its `Handler` impl, for a handler that passed validation.
pub fn expand(h: &Handler) -> TokenStream {
    let rt = quote!(::inbox_runtime::__private);
    let func = &with_explicit_tx_lifetime(h);
    let name = &func.sig.ident;
    let consumer = &h.consumer;
    let db = &h.db;
    let msg_ty = &h.message.ty;
    let ret = &h.ret;

    let msg_var = format_ident!("__inbox_msg");
    let tx_var = format_ident!("__inbox_tx");
    let state_var = format_ident!("__inbox_state");
    let delivery_var = format_ident!("__inbox_delivery");

    let (state_ty, state_bind) = match &h.state {
        Some(p) => {
            let ty = &p.ty;
            let pat = &p.pat;
            (
                quote!(#ty),
                quote!(#[allow(unused_variables, unused_mut)] let #pat = #state_var;),
            )
        }
        None => (quote!(()), quote!(let _ = #state_var;)),
    };

    let delivery_bind = match &h.delivery {
        Some(p) => {
            let pat = &p.pat;
            quote!(#[allow(unused_variables, unused_mut)] let #pat = #delivery_var;)
        }
        None => quote!(let _ = #delivery_var;),
    };

    // The key expression sees the message (and the delivery and state) by reference, so
    // `key = msg.id` reads the field without moving it out of the message the body receives
    // afterwards.
    let key_body = match &h.key {
        Some(expr) => {
            let pat = &h.message.pat;
            let text = expression_text(expr);
            quote_spanned! {expr.span()=>
                #[allow(unused_variables, unused_mut)]
                let #pat = #msg_var;
                #state_bind
                #delivery_bind
                ::core::result::Result::map(
                    #rt::key_of(&(#expr), #text),
                    ::core::option::Option::Some,
                )
            }
        }
        None => quote! {
            let _ = (#msg_var, #state_var, #delivery_var);
            ::core::result::Result::Ok(::core::option::Option::None)
        },
    };

    let mut call_args = vec![TokenStream::new(); h.arity];
    call_args[h.message.index] = quote!(#msg_var);
    call_args[h.tx.index] = quote!(#tx_var);
    if let Some(s) = &h.state {
        call_args[s.index] = quote!(#state_var);
    }
    if let Some(d) = &h.delivery {
        call_args[d.index] = quote!(#delivery_var);
    }

    // The shape `Result<(), E>` is checked once, by the compiler through the runtime's
    // `ReturnsUnit`, spanned on the user's return type. Every other mention of the error type
    // resolves for any `Result<T, E>` (through `HandlerResult`, which also sees through aliases
    // such as `io::Result<()>`), and the body's `Ok` value is mapped to `()` (a no-op once the
    // check passes), so that a wrong `Ok` type is not reported again as a mismatched future.
    let error_ty = quote_spanned! {ret.span()=> <#ret as #rt::HandlerResult>::Error };
    let returns_unit = returns_unit_check(ret);

    let unit = unit_struct(func, Some(consumer));

    let types = ImplTypes {
        db: quote!(#db),
        message: quote!(#msg_ty),
        state: state_ty,
        error: error_ty,
        consumer: quote!(#consumer),
        codec: codec_of(h.codec.as_ref()),
    };
    let handle_body = quote! {
        #returns_unit
        #func
        let __inbox_fut = #name(#(#call_args),*);
        async move { ::core::result::Result::map(__inbox_fut.await, |_| ()) }
    };
    let handler = if h.claim {
        // Two-phase: the runtime calls `handle_claimed` alone (`TWO_PHASE`), with the claim in the
        // place of the transaction; `handle` is never called.
        call_args[h.tx.index] = quote!(__inbox_claim);
        let claimed_body = quote! {
            #returns_unit
            #func
            let __inbox_fut = #name(#(#call_args),*);
            async move {
                ::core::result::Result::map_err(
                    ::core::result::Result::map(__inbox_fut.await, |_| ()),
                    ::core::convert::Into::<#rt::BoxError>::into,
                )
            }
        };
        let never = quote! {
            let _ = (__inbox_msg, __inbox_delivery, __inbox_tx, __inbox_state);
            async move {
                ::core::unreachable!("a two-phase handler runs through Handler::handle_claimed")
            }
        };
        let extra = quote! {
            const TWO_PHASE: bool = true;

            fn handle_claimed<'__a>(
                &'__a self,
                __inbox_msg: Self::Message,
                __inbox_delivery: &'__a #rt::Delivery,
                __inbox_claim: &'__a mut #rt::Claim<Self::Db>,
                __inbox_state: &'__a Self::State,
            ) -> impl ::core::future::Future<
                Output = ::core::result::Result<(), #rt::BoxError>,
            > + ::core::marker::Send + '__a {
                #claimed_body
            }
        };
        handler_impl(name, &types, key_body, never, extra)
    } else {
        let lane = h.lane.as_ref().map(|expr| {
            // Like the key: the expression sees the message, delivery and state by reference.
            let pat = &h.message.pat;
            let body = quote_spanned! {expr.span()=>
                #[allow(unused_variables, unused_mut)]
                let #pat = #msg_var;
                #state_bind
                #delivery_bind
                #rt::lane_of(&(#expr))
            };
            quote! {
                const LANED: bool = true;

                #[allow(clippy::needless_borrow)]
                fn lane(
                    &self,
                    __inbox_msg: &Self::Message,
                    __inbox_delivery: &#rt::Delivery,
                    __inbox_state: &Self::State,
                ) -> ::core::option::Option<#rt::Lane> {
                    #body
                }
            }
        });
        let reject = h.reject_key_reuse.then(|| {
            quote!(
                const REJECT_KEY_REUSE: bool = true;
            )
        });
        let extra = quote!(#lane #reject);
        handler_impl(name, &types, key_body, handle_body, extra)
    };
    quote! {
        #unit
        #handler
    }
}

/// `expr` as a user would write it, for error messages: the tokens without the spaces printing
/// puts around `.`, `::` and brackets (`delivery.header("Idempotency-Key")`).
fn expression_text(expr: &syn::Expr) -> String {
    let mut text = quote!(#expr).to_string();
    for (spaced, tight) in [
        (" . ", "."),
        (" :: ", "::"),
        (" (", "("),
        ("( ", "("),
        (" )", ")"),
        (" [", "["),
        ("[ ", "["),
        (" ]", "]"),
        (" ,", ","),
        ("& ", "&"),
        (" !", "!"),
    ] {
        text = text.replace(spaced, tight);
    }
    text
}

/// A statement that compiles only when `ret` is `Result<(), E>`, reported once, on `ret`.
pub fn returns_unit_check(ret: &Type) -> TokenStream {
    let rt = quote!(::inbox_runtime::__private);
    quote_spanned! {ret.span()=>
        let _: ::core::marker::PhantomData<<#ret as #rt::ReturnsUnit>::Unit> =
            ::core::marker::PhantomData;
    }
}

/// The associated items of a `Handler` impl, as tokens.
pub struct ImplTypes {
    pub db: TokenStream,
    pub message: TokenStream,
    pub state: TokenStream,
    pub error: TokenStream,
    pub consumer: TokenStream,
    pub codec: TokenStream,
}

/// The codec type: as given with `codec = ..`, else JSON.
pub fn codec_of(codec: Option<&Type>) -> TokenStream {
    match codec {
        Some(ty) => quote!(#ty),
        None => quote!(::inbox_runtime::__private::Json),
    }
}

/// The `impl Handler` that both the expansion and the fallback emit, around their `key` and
/// `handle` bodies. The bodies see the arguments as `__inbox_msg`, `__inbox_delivery`,
/// `__inbox_tx`, `__inbox_state`.
pub fn handler_impl(
    name: &syn::Ident,
    types: &ImplTypes,
    key_body: TokenStream,
    handle_body: TokenStream,
    extra: TokenStream,
) -> TokenStream {
    let rt = quote!(::inbox_runtime::__private);
    let ImplTypes {
        db,
        message,
        state,
        error,
        consumer,
        codec,
    } = types;
    quote! {
        #[automatically_derived]
        impl #rt::Handler for #name {
            type Db = #db;
            type Message = #message;
            type State = #state;
            type Error = #error;
            type Codec = #codec;

            const CONSUMER: &'static str = #consumer;

            #[allow(clippy::needless_borrow, clippy::unnecessary_to_owned)]
            fn key(
                &self,
                __inbox_msg: &Self::Message,
                __inbox_delivery: &#rt::Delivery,
                __inbox_state: &Self::State,
            ) -> ::core::result::Result<
                ::core::option::Option<::std::string::String>,
                #rt::KeyError,
            > {
                #key_body
            }

            fn handle<'__a, '__c>(
                &'__a self,
                __inbox_msg: Self::Message,
                __inbox_delivery: &'__a #rt::Delivery,
                __inbox_tx: &'__a mut #rt::Transaction<'__c, Self::Db>,
                __inbox_state: &'__a Self::State,
            ) -> impl ::core::future::Future<
                Output = ::core::result::Result<(), Self::Error>,
            > + ::core::marker::Send + '__a {
                #handle_body
            }

            #extra
        }
    }
}

/// The unit struct that stands for the handler, named after the function and carrying its
/// visibility and docs; also emitted by the fallback, so that uses of the handler resolve even when
/// the handler has mistakes.
pub fn unit_struct(func: &ItemFn, consumer: Option<&LitStr>) -> TokenStream {
    let vis = &func.vis;
    let name = &func.sig.ident;
    let docs: Vec<_> = func
        .attrs
        .iter()
        .filter(|a| a.path().is_ident("doc"))
        .collect();
    let default_doc = docs.is_empty().then(|| {
        let text = match consumer {
            Some(consumer) => format!(
                " Idempotent handler `{name}` for consumer `{}`, generated by `#[idempotent]`.",
                consumer.value()
            ),
            None => format!(" Idempotent handler `{name}`, generated by `#[idempotent]`."),
        };
        quote!(#[doc = #text])
    });
    quote! {
        #(#docs)*
        #default_doc
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, Default)]
        #vis struct #name;
    }
}

/// The user's function with `'_` written into the transaction type when it was elided:
/// `&mut Tx<Postgres>` reads naturally, but an `async fn` must name every lifetime in a path.
/// The body is untouched.
fn with_explicit_tx_lifetime(h: &Handler) -> ItemFn {
    let mut func = h.func.clone();
    explicit_mut_ref_lifetimes(&mut func);
    func
}

/// Writes `'_` into every `&mut Path<..>` parameter type that names no lifetime. Also applied to
/// the function the fallback keeps, so that the user sees our error alone.
pub fn explicit_mut_ref_lifetimes(func: &mut ItemFn) {
    for input in func.sig.inputs.iter_mut() {
        if let FnArg::Typed(arg) = input
            && let Type::Reference(r) = &mut *arg.ty
            && r.mutability.is_some()
            && !crate::validate::is_claim(&r.elem)
            && let Type::Path(p) = &mut *r.elem
            && let Some(last) = p.path.segments.last_mut()
            && let PathArguments::AngleBracketed(args) = &mut last.arguments
            && !args
                .args
                .iter()
                .any(|a| matches!(a, GenericArgument::Lifetime(_)))
        {
            args.args.insert(0, parse_quote!('_));
        }
    }
}
