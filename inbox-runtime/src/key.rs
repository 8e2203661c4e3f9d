//! Message keys: what a `key = ...` expression may evaluate to, and the limits on keys.

use std::borrow::Cow;
use std::rc::Rc;
use std::sync::Arc;

/// The longest key the inbox table's `message_key` column holds, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A value usable as a message key: strings, integers and (feature `uuid`) `Uuid`; a `key`
/// expression may also give an `Option` of one (`delivery.header("Idempotency-Key")`), whose
/// `None` is a permanent error naming the expression.
///
/// A composite key is a string: `key = format!("{}:{}", msg.tenant, msg.id)`.
///
/// ```
/// use inbox_runtime::ToMessageKey;
/// assert_eq!(42u64.to_message_key(), "42");
/// assert_eq!("order-7".to_message_key(), "order-7");
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a message key",
    label = "the `key` expression gives a `{Self}`",
    note = "keys are strings, integers or `Uuid` (feature `uuid`), or an `Option` of one; make a composite key a string: `key = format!(\"{{}}:{{}}\", msg.tenant, msg.id)`, or implement `inbox_runtime::ToMessageKey` for the type"
)]
pub trait ToMessageKey {
    /// The key as stored in `inbox.message_key`.
    fn to_message_key(&self) -> String;
}

impl ToMessageKey for str {
    fn to_message_key(&self) -> String {
        self.to_owned()
    }
}
impl ToMessageKey for String {
    fn to_message_key(&self) -> String {
        self.clone()
    }
}
impl<T: ToMessageKey + ?Sized> ToMessageKey for &T {
    fn to_message_key(&self) -> String {
        (**self).to_message_key()
    }
}
impl<T: ToMessageKey + ?Sized> ToMessageKey for Box<T> {
    fn to_message_key(&self) -> String {
        (**self).to_message_key()
    }
}
impl<T: ToMessageKey + ?Sized> ToMessageKey for Arc<T> {
    fn to_message_key(&self) -> String {
        (**self).to_message_key()
    }
}
impl<T: ToMessageKey + ?Sized> ToMessageKey for Rc<T> {
    fn to_message_key(&self) -> String {
        (**self).to_message_key()
    }
}
impl ToMessageKey for Cow<'_, str> {
    fn to_message_key(&self) -> String {
        self.as_ref().to_owned()
    }
}
macro_rules! int_keys {
    ($($t:ty),*) => {$(
        impl ToMessageKey for $t {
            fn to_message_key(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
int_keys!(
    i8, i16, i32, i64, i128, isize, u8, u16, u32, u64, u128, usize
);
#[cfg(feature = "uuid")]
#[cfg_attr(docsrs, doc(cfg(feature = "uuid")))]
impl ToMessageKey for uuid::Uuid {
    fn to_message_key(&self) -> String {
        self.hyphenated().to_string()
    }
}

/// Why a key cannot be stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is the empty string.
    #[error("the message key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    #[error("the message key is {0} bytes long; at most {MAX_KEY_LEN} bytes are allowed")]
    TooLong(usize),
    /// The key contains a NUL byte, which PostgreSQL cannot store in text: rejected on every
    /// backend, so that a key means the same on all of them.
    #[error("the message key contains a NUL byte")]
    Nul,
    /// The `key` expression gave `None`: the message lacks what its key is made of (a header,
    /// an optional field).
    #[error("the key expression `{0}` gave None: the message has no key")]
    Absent(&'static str),
    /// The handler has no `key` and the message carries no transport id.
    #[error("no message key: the handler has no `key` and the message has no transport id")]
    Missing,
}

/// Checks a key against the inbox table's limits.
pub fn validate_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        Err(KeyError::Empty)
    } else if key.len() > MAX_KEY_LEN {
        Err(KeyError::TooLong(key.len()))
    } else if key.contains('\0') {
        Err(KeyError::Nul)
    } else {
        Ok(())
    }
}

/// What a `key` expression may evaluate to: a [`ToMessageKey`] value, or an `Option` of one.
/// Not public API: the code `#[idempotent]` generates goes through it.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a message key",
    label = "the `key` expression gives a `{Self}`",
    note = "keys are strings, integers or `Uuid` (feature `uuid`), or an `Option` of one; make a composite key a string: `key = format!(\"{{}}:{{}}\", msg.tenant, msg.id)`, or implement `inbox_runtime::ToMessageKey` for the type"
)]
pub trait KeyOf {
    /// The key, or why there is none; `expr` is the expression as written.
    fn key_of(&self, expr: &'static str) -> Result<String, KeyError>;
}

impl<T: ToMessageKey + ?Sized> KeyOf for T {
    fn key_of(&self, _: &'static str) -> Result<String, KeyError> {
        Ok(self.to_message_key())
    }
}

impl<T: ToMessageKey> KeyOf for Option<T> {
    fn key_of(&self, expr: &'static str) -> Result<String, KeyError> {
        match self {
            Some(key) => Ok(key.to_message_key()),
            None => Err(KeyError::Absent(expr)),
        }
    }
}
