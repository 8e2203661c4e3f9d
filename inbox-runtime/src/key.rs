//! Message keys: what a `key = ...` expression may evaluate to, and the limits on keys.

use std::borrow::Cow;
use std::rc::Rc;
use std::sync::Arc;

/// The longest key the inbox table's `message_key` column holds, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A value usable as a message key: strings, integers and (feature `uuid`) `Uuid`.
///
/// ```
/// use inbox_runtime::ToMessageKey;
/// assert_eq!(42u64.to_message_key(), "42");
/// assert_eq!("order-7".to_message_key(), "order-7");
/// ```
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
impl ToMessageKey for uuid::Uuid {
    fn to_message_key(&self) -> String {
        self.hyphenated().to_string()
    }
}

/// Why a key cannot be stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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

/// The message's key: the handler's `key` expression, else the transport id; validated.
pub(crate) fn message_key<H: crate::Handler>(
    handler: &H,
    state: &H::State,
    message: &H::Message,
    transport_id: Option<&str>,
) -> Result<String, KeyError> {
    let key = match handler.key(message, state) {
        Some(k) => k,
        None => transport_id.ok_or(KeyError::Missing)?.to_owned(),
    };
    validate_key(&key)?;
    Ok(key)
}
