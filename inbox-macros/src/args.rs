//! Parsing of the attribute's arguments: `consumer = "name", key = <expr>`, `lane = <expr>`,
//! `codec = <type>`, `claim`, `on_key_reuse = reject|skip`.

use syn::parse::{Parse, ParseStream};
use syn::{Expr, LitStr, Token};

mod kw {
    syn::custom_keyword!(consumer);
    syn::custom_keyword!(key);
    syn::custom_keyword!(claim);
    syn::custom_keyword!(codec);
    syn::custom_keyword!(lane);
    syn::custom_keyword!(on_key_reuse);
}

/// The longest consumer name the inbox table's `consumer` column holds.
pub const MAX_CONSUMER_LEN: usize = 200;

const VALID: &str = "valid arguments are `consumer = \"...\"`, `key = <expression>`, `lane = <expression>` (what the handler locks, for batches), `codec = <type>` (default `Json`), `claim` (two-phase) and `on_key_reuse = reject` (default `skip`)";

/// The arguments as written, each at most once.
pub struct Args {
    pub consumer: Option<LitStr>,
    pub key: Option<Expr>,
    /// `lane = <expr>`: what the handler locks (an account), so that batches take locks in one
    /// order.
    pub lane: Option<Expr>,
    /// `claim`: a two-phase handler, for side effects outside the database.
    pub claim: Option<proc_macro2::Span>,
    /// `codec = Raw`: how the payload decodes (default `::inbox_runtime::Json`).
    pub codec: Option<syn::Type>,
    /// `on_key_reuse = reject`: a duplicate key with another payload is dead-lettered (the
    /// span of `reject`); `skip`, the default, skips it (both count and log it).
    pub reject_key_reuse: Option<proc_macro2::Span>,
    /// Mistakes in arguments that still parsed (unknown, repeated, a value where none goes):
    /// reported with the signature's, which is checked against what was meant.
    pub errors: Option<syn::Error>,
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args {
            consumer: None,
            key: None,
            lane: None,
            claim: None,
            codec: None,
            reject_key_reuse: None,
            errors: None,
        };
        let mut errors: Option<syn::Error> = None;
        let mut seen_key_reuse = false;
        let mut push = |e: syn::Error| match &mut errors {
            Some(all) => all.combine(e),
            None => errors = Some(e),
        };
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::consumer) {
                let name = input.parse::<kw::consumer>()?;
                input.parse::<Token![=]>()?;
                let value: LitStr = input.parse()?;
                if args.consumer.is_some() {
                    push(syn::Error::new(name.span, "`consumer` set multiple times"));
                } else {
                    args.consumer = Some(value);
                }
            } else if lookahead.peek(kw::key) {
                let name = input.parse::<kw::key>()?;
                input.parse::<Token![=]>()?;
                let value: Expr = input.parse()?;
                if args.key.is_some() {
                    push(syn::Error::new(name.span, "`key` set multiple times"));
                } else {
                    args.key = Some(value);
                }
            } else if lookahead.peek(kw::lane) {
                let name = input.parse::<kw::lane>()?;
                input.parse::<Token![=]>()?;
                let value: Expr = input.parse()?;
                if args.lane.is_some() {
                    push(syn::Error::new(name.span, "`lane` set multiple times"));
                } else {
                    args.lane = Some(value);
                }
            } else if lookahead.peek(kw::codec) {
                let name = input.parse::<kw::codec>()?;
                input.parse::<Token![=]>()?;
                let value: syn::Type = input.parse()?;
                if args.codec.is_some() {
                    push(syn::Error::new(name.span, "`codec` set multiple times"));
                } else {
                    args.codec = Some(value);
                }
            } else if lookahead.peek(kw::on_key_reuse) {
                let name = input.parse::<kw::on_key_reuse>()?;
                input.parse::<Token![=]>()?;
                let value: syn::Ident = input.parse()?;
                match value.to_string().as_str() {
                    _ if seen_key_reuse => push(syn::Error::new(
                        name.span,
                        "`on_key_reuse` set multiple times",
                    )),
                    "reject" => args.reject_key_reuse = Some(value.span()),
                    "skip" => {}
                    other => push(syn::Error::new(
                        value.span(),
                        format!(
                            "`on_key_reuse = {other}`: write `reject` (dead-letter a key reused with another payload) or `skip` (the default)"
                        ),
                    )),
                }
                seen_key_reuse = true;
            } else if lookahead.peek(kw::claim) {
                let name = input.parse::<kw::claim>()?;
                if input.peek(Token![=]) || input.peek(syn::token::Paren) {
                    push(syn::Error::new(
                        name.span,
                        "`claim` takes no value: write `claim` alone (the lease is `Inbox::lease`)",
                    ));
                    while !input.is_empty() && !input.peek(Token![,]) {
                        input.parse::<proc_macro2::TokenTree>()?;
                    }
                    // Meant as a two-phase handler all the same: its signature is checked so.
                    args.claim.get_or_insert(name.span);
                } else if args.claim.is_some() {
                    push(syn::Error::new(name.span, "`claim` set multiple times"));
                } else {
                    args.claim = Some(name.span);
                }
            } else if input.peek(syn::Ident) {
                let ident: syn::Ident = input.parse()?;
                push(syn::Error::new(
                    ident.span(),
                    format!("unknown argument `{ident}`; {VALID}"),
                ));
                // Skip the rest of this argument so that later ones are still checked.
                while !input.is_empty() && !input.peek(Token![,]) {
                    input.parse::<proc_macro2::TokenTree>()?;
                }
            } else {
                return Err(lookahead.error());
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        args.errors = errors;
        Ok(args)
    }
}
