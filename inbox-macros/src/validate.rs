//! Checks the annotated function and turns it, with the arguments, into the handler's description,
//! or, when something is wrong, into the errors plus what the signature still tells.

use crate::args::{Args, MAX_CONSUMER_LEN};
use syn::spanned::Spanned;
use syn::{Expr, FnArg, GenericArgument, ItemFn, LitStr, Pat, PathArguments, ReturnType, Type};

/// One parameter of the handler: where it stands and what it is.
pub struct Param {
    /// Position in the user's parameter list.
    pub index: usize,
    /// The binding pattern as written (`msg`, `mut msg`, `Credit { id, .. }`).
    pub pat: Box<Pat>,
    /// For the message, its type; for the state, the referent of `&State`.
    pub ty: Type,
}

/// A validated handler, ready to expand.
pub struct Handler {
    pub func: ItemFn,
    pub consumer: LitStr,
    pub key: Option<Expr>,
    /// `lane = <expr>`, when given.
    pub lane: Option<Expr>,
    pub message: Param,
    pub tx: Param,
    /// The database type named in the transaction argument (`Postgres` in `&mut Tx<Postgres>`).
    pub db: Type,
    pub state: Option<Param>,
    /// The `&Delivery` argument, when the handler takes one.
    pub delivery: Option<Param>,
    /// `codec = ..`, when given.
    pub codec: Option<Type>,
    pub ret: Type,
    pub arity: usize,
    /// Two-phase (`claim`): `tx` is then the `&mut Claim<DB>` argument.
    pub claim: bool,
    /// `on_key_reuse = reject`.
    pub reject_key_reuse: bool,
}

/// A handler with mistakes: every error found, and what is known regardless, so that the fallback
/// can still emit the unit struct (and a stub `Handler` impl) and each mistake is reported once.
pub struct Invalid {
    /// All errors, combined.
    pub error: syn::Error,
    /// The function as written.
    pub func: ItemFn,
    /// The consumer name, when given.
    pub consumer: Option<LitStr>,
    /// The types of the `Handler` impl, when the signature names them all.
    pub types: Option<Types>,
    /// Whether the function can stand alone as a nested item: a `self` parameter would add an
    /// error of its own there.
    pub keep_body: bool,
}

/// The associated types of a `Handler` impl as far as the signature determines them.
pub struct Types {
    /// The database named in the transaction argument.
    pub db: Type,
    /// The message argument's type.
    pub message: Type,
    /// The referent of the `&State` argument; `None` when there is none.
    pub state: Option<Type>,
    /// The declared return type when it is a `Result`; `None` when it is missing or not one.
    pub ret: Option<Type>,
    /// `codec = ..`, when given.
    pub codec: Option<Type>,
}

#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, span: proc_macro2::Span, msg: impl std::fmt::Display) {
        self.add(syn::Error::new(span, msg));
    }

    fn add(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }
}

const TX_HINT: &str = "add a transaction argument such as `tx: &mut Tx<Postgres>`";

/// Validates `func` and the attribute's arguments against the handler contract; every problem
/// found is reported, each spanned on the token that causes it. An argument list that did not parse
/// still lets the signature be checked, so that all mistakes show at once.
pub fn validate(args: syn::Result<Args>, func: ItemFn) -> Result<Handler, Box<Invalid>> {
    let mut errors = Errors::default();
    let sig = &func.sig;
    let mut reject_key_reuse = false;
    let (consumer, key, lane, claim, codec) = match args {
        Ok(args) => {
            if let Some(e) = args.errors {
                errors.add(e);
            }
            if let (Some(reject), Some(_)) = (args.reject_key_reuse, args.claim) {
                errors.push(
                    reject,
                    "`on_key_reuse` is checked against the payload a marker keeps, and a two-phase claim (`claim`) keeps none: remove `on_key_reuse`",
                );
            }
            reject_key_reuse = args.reject_key_reuse.is_some();
            if let (Some(lane), Some(_)) = (&args.lane, args.claim) {
                errors.push(
                    lane.span(),
                    "`lane` orders batches, and a two-phase handler (`claim`) is never batched: remove `lane`",
                );
            }
            (
                check_consumer(args.consumer, &mut errors),
                args.key,
                args.lane,
                args.claim,
                args.codec,
            )
        }
        Err(e) => {
            errors.add(e);
            (None, None, None, None, None)
        }
    };

    if sig.asyncness.is_none() {
        errors.push(
            sig.fn_token.span,
            "`#[idempotent]` handlers must be `async fn`",
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.push(
            sig.generics.span(),
            "`#[idempotent]` handlers cannot be generic",
        );
    }

    let mut message: Option<Param> = None;
    let mut tx: Option<(Param, Option<Type>)> = None;
    let mut state: Option<Param> = None;
    let mut delivery: Option<Param> = None;
    for (index, input) in sig.inputs.iter().enumerate() {
        let arg = match input {
            FnArg::Receiver(r) => {
                errors.push(r.span(), "`#[idempotent]` handlers cannot take `self`");
                continue;
            }
            FnArg::Typed(arg) => arg,
        };
        match &*arg.ty {
            Type::Reference(r) if r.mutability.is_some() => {
                let takes_claim = is_claim(&r.elem);
                if takes_claim && claim.is_none() {
                    errors.push(
                        arg.span(),
                        "a handler taking `&mut Claim<DB>` is two-phase: add `claim` to the attribute, as in `#[idempotent(consumer = \"email\", key = msg.id, claim)]`",
                    );
                } else if !takes_claim && claim.is_some() {
                    errors.push(
                        arg.span(),
                        "a `claim` handler takes `claim: &mut Claim<DB>` instead of a transaction: its side effect runs outside one, and `claim.tx().await?` gives the transaction that commits with \"done\"",
                    );
                }
                if tx.is_some() {
                    errors.push(
                        arg.span(),
                        "only one `&mut` argument is allowed: the transaction",
                    );
                    continue;
                }
                let db = database_of(&r.elem);
                if db.is_none() {
                    errors.push(
                        r.elem.span(),
                        "the transaction argument must be `&mut Tx<DB>` (or `&mut sqlx::Transaction<'_, DB>`)",
                    );
                }
                let param = Param {
                    index,
                    pat: arg.pat.clone(),
                    ty: (*r.elem).clone(),
                };
                tx = Some((param, db));
            }
            Type::Reference(r) if is_delivery(&r.elem) => {
                if delivery.is_some() {
                    errors.push(arg.span(), "only one `&Delivery` argument is allowed");
                    continue;
                }
                delivery = Some(Param {
                    index,
                    pat: arg.pat.clone(),
                    ty: (*r.elem).clone(),
                });
            }
            Type::Reference(r) => {
                if state.is_some() {
                    errors.push(
                        arg.span(),
                        "only one `&` argument besides `&Delivery` is allowed: the handler's shared state",
                    );
                    continue;
                }
                state = Some(Param {
                    index,
                    pat: arg.pat.clone(),
                    ty: (*r.elem).clone(),
                });
            }
            ty => {
                if message.is_some() {
                    errors.push(
                        arg.span(),
                        "only one message argument (taken by value) is allowed",
                    );
                    continue;
                }
                message = Some(Param {
                    index,
                    pat: arg.pat.clone(),
                    ty: ty.clone(),
                });
            }
        }
    }
    if message.is_none() {
        errors.push(
            sig.paren_token.span.join(),
            "missing message argument: add the decoded message, taken by value, such as `msg: CreditRequested`",
        );
    }
    if tx.is_none() {
        let hint = match claim {
            Some(_) => {
                "missing claim argument: add `claim: &mut Claim<Postgres>` (or your database)"
                    .to_owned()
            }
            None => format!("missing transaction argument: {TX_HINT}"),
        };
        errors.push(sig.paren_token.span.join(), hint);
    }

    let ret = match &sig.output {
        ReturnType::Default => {
            errors.push(
                sig.paren_token.span.close(),
                "`#[idempotent]` handlers must return `Result<(), E>`",
            );
            None
        }
        ReturnType::Type(_, ty) if !is_result(ty) => {
            errors.push(
                ty.span(),
                "`#[idempotent]` handlers must return `Result<(), E>`",
            );
            None
        }
        ReturnType::Type(_, ty) => Some((**ty).clone()),
    };

    if let Some(error) = errors.0 {
        let (_, db) = tx.unzip();
        // A generic signature's types may name its parameters, which the impl does not have.
        let types = match (db.flatten(), message) {
            (Some(db), Some(message)) if sig.generics.params.is_empty() => Some(Types {
                db,
                message: message.ty,
                state: state.map(|s| s.ty),
                ret,
                codec,
            }),
            _ => None,
        };
        let keep_body = sig.receiver().is_none();
        return Err(Box::new(Invalid {
            error,
            consumer,
            types,
            keep_body,
            func,
        }));
    }
    // With no errors pushed, every piece is present.
    let (tx, db) = tx.expect("checked above");
    Ok(Handler {
        arity: sig.inputs.len(),
        consumer: consumer.expect("checked above"),
        key,
        lane,
        message: message.expect("checked above"),
        tx,
        db: db.expect("checked above"),
        state,
        delivery,
        codec,
        ret: ret.expect("checked above"),
        func,
        claim: claim.is_some(),
        reject_key_reuse,
    })
}

/// Checks the consumer name; the name is returned when present, even if too long or empty, since
/// the error already says so.
fn check_consumer(consumer: Option<LitStr>, errors: &mut Errors) -> Option<LitStr> {
    match consumer {
        None => {
            errors.push(
                proc_macro2::Span::call_site(),
                "missing `consumer = \"...\"`: the name under which this handler's markers are stored",
            );
            None
        }
        Some(lit) => {
            let value = lit.value();
            if value.is_empty() {
                errors.push(lit.span(), "`consumer` must not be empty");
            } else if value.len() > MAX_CONSUMER_LEN {
                errors.push(
                    lit.span(),
                    format!(
                        "`consumer` is {} bytes long; at most {MAX_CONSUMER_LEN} bytes fit the inbox table",
                        value.len()
                    ),
                );
            } else if !value
                .bytes()
                .all(|b| b.is_ascii_graphic() && !matches!(b, b'.' | b'*' | b'>'))
            {
                // The runtime refuses it at start anyway (dead letters go to
                // `<prefix>.<consumer>`); saying so here saves a failed deployment.
                errors.push(
                    lit.span(),
                    "`consumer` must be one NATS subject token (dead letters go to `<prefix>.<consumer>`): use letters, digits, `-` and `_`, without spaces, `.`, `*` or `>`",
                );
            }
            Some(lit)
        }
    }
}

/// Whether `ty` is a path ending in `Claim`: `Claim<Postgres>`, `inbox_runtime::Claim<DB>`.
pub fn is_claim(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "Claim"))
}

/// Whether `ty` names the runtime's delivery: `Delivery` or `inbox_runtime::Delivery` (also
/// through a macro's `$t:ty` group or parentheses). Another crate's `Delivery`
/// (`shipping::Delivery`) is state; a `Delivery` of one's own imported by that name is caught by
/// the compiler, as the type of the argument the generated code passes.
pub fn is_delivery(ty: &Type) -> bool {
    match ty {
        Type::Group(g) => is_delivery(&g.elem),
        Type::Paren(p) => is_delivery(&p.elem),
        Type::Path(p) if p.qself.is_none() => {
            let segments: Vec<_> = p.path.segments.iter().collect();
            let plain = |s: &syn::PathSegment, name: &str| s.ident == name && s.arguments.is_none();
            match segments.as_slice() {
                [one] => plain(one, "Delivery") && p.path.leading_colon.is_none(),
                [krate, one] => plain(krate, "inbox_runtime") && plain(one, "Delivery"),
                _ => false,
            }
        }
        _ => false,
    }
}

/// The last type argument of the last path segment: `Postgres` in `Tx<Postgres>`,
/// `Tx<'_, Postgres>` and `sqlx::Transaction<'static, sqlx::Postgres>`.
fn database_of(ty: &Type) -> Option<Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    args.args.iter().rev().find_map(|arg| match arg {
        GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    })
}

/// `Result<..>`, `io::Result<..>`, `anyhow::Result<..>`: any path whose last segment is `Result`.
/// The exact shape (`Result<(), E>`) is checked by the compiler through the runtime's
/// `ReturnsUnit` trait, on the user's return type.
fn is_result(ty: &Type) -> bool {
    match ty {
        Type::Path(p) => p.path.segments.last().is_some_and(|s| s.ident == "Result"),
        Type::Paren(p) => is_result(&p.elem),
        _ => false,
    }
}
