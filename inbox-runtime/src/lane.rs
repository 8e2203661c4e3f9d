//! Lanes: what a handler locks, named so that batches do not fight over it.
//!
//! A handler that updates a row per account (a balance, a stock level) names the account as its
//! lane: `#[idempotent(consumer = "credit", key = msg.id, lane = msg.account)]`. A batched
//! worker then keeps each lane in one of its batch slots (messages of one lane never sit in two
//! of its batches at once), and every batch, in every process, runs its messages in lane order,
//! so that all of them take their row locks in one order and none waits for another in a circle.
//! Integers order by value and text by its bytes, which is also the order of a B-tree index on
//! an integer column or a binary-collated text column: batches that insert rows take their gap
//! locks (InnoDB) in index order as well. A text column with a case- or accent-insensitive
//! collation (MySQL's default) sees `"Alice"` and `"alice"` as one row but they are two lanes:
//! give the lane in the column's normal form (`lane = msg.user.to_lowercase()`).

use std::cmp::Ordering;

/// A message's lane: an integer or a string, ordered by value.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Lane(Value);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Value {
    Int(i128),
    Bytes(Box<[u8]>),
}

impl PartialOrd for Lane {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Lane {
    fn cmp(&self, other: &Self) -> Ordering {
        match (&self.0, &other.0) {
            (Value::Int(a), Value::Int(b)) => a.cmp(b),
            (Value::Bytes(a), Value::Bytes(b)) => a.cmp(b),
            (Value::Int(_), Value::Bytes(_)) => Ordering::Less,
            (Value::Bytes(_), Value::Int(_)) => Ordering::Greater,
        }
    }
}

impl Lane {
    /// The lane of an integer.
    pub fn int(value: impl Into<i128>) -> Lane {
        Lane(Value::Int(value.into()))
    }

    /// The lane of a string or bytes.
    pub fn bytes(value: impl AsRef<[u8]>) -> Lane {
        Lane(Value::Bytes(value.as_ref().into()))
    }

    /// Which of `slots` batch slots the lane belongs to: the same in every process and build
    /// (FNV-1a of its value), so that it also spreads evenly where lanes are consecutive numbers.
    pub fn slot(&self, slots: usize) -> usize {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |bytes: &[u8]| {
            for b in bytes {
                hash ^= u64::from(*b);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        match &self.0 {
            Value::Int(i) => eat(&i.to_le_bytes()),
            Value::Bytes(b) => {
                eat(&[0xff]);
                eat(b);
            }
        }
        (hash % slots.max(1) as u64) as usize
    }
}

/// What a `lane = <expr>` expression may give: integers, strings, bytes, references to them, and
/// `Option`s of them (`None`: the message has no lane).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a lane",
    label = "the `lane` expression gives a `{Self}`",
    note = "lanes are integers, strings, bytes or `Uuid` (feature `uuid`), or an `Option` of one: name the row the handler locks, as in `lane = msg.account`"
)]
pub trait LaneOf {
    /// The lane, or `None`.
    fn lane_of(&self) -> Option<Lane>;
}

macro_rules! int_lanes {
    ($($t:ty),*) => {$(
        impl LaneOf for $t {
            fn lane_of(&self) -> Option<Lane> {
                Some(Lane::int(*self))
            }
        }
    )*};
}
int_lanes!(i8, i16, i32, i64, i128, u8, u16, u32, u64);

impl LaneOf for usize {
    fn lane_of(&self) -> Option<Lane> {
        Some(Lane::int(*self as u64))
    }
}

impl LaneOf for isize {
    fn lane_of(&self) -> Option<Lane> {
        Some(Lane::int(*self as i64))
    }
}

impl LaneOf for str {
    fn lane_of(&self) -> Option<Lane> {
        Some(Lane::bytes(self))
    }
}

impl LaneOf for String {
    fn lane_of(&self) -> Option<Lane> {
        Some(Lane::bytes(self))
    }
}

impl LaneOf for [u8] {
    fn lane_of(&self) -> Option<Lane> {
        Some(Lane::bytes(self))
    }
}

impl LaneOf for Vec<u8> {
    fn lane_of(&self) -> Option<Lane> {
        Some(Lane::bytes(self))
    }
}

#[cfg(feature = "uuid")]
impl LaneOf for uuid::Uuid {
    fn lane_of(&self) -> Option<Lane> {
        Some(Lane::bytes(self.as_bytes()))
    }
}

impl<T: LaneOf + ?Sized> LaneOf for &T {
    fn lane_of(&self) -> Option<Lane> {
        (**self).lane_of()
    }
}

impl<T: LaneOf> LaneOf for Option<T> {
    fn lane_of(&self) -> Option<Lane> {
        self.as_ref().and_then(LaneOf::lane_of)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_order_by_value_and_slot_the_same_everywhere() {
        let mut lanes = vec![10u64.lane_of(), 9i32.lane_of(), (-3i64).lane_of(), None];
        lanes.sort();
        assert_eq!(
            lanes,
            vec![
                None,
                Some(Lane::int(-3)),
                Some(Lane::int(9)),
                Some(Lane::int(10))
            ]
        );
        assert!(Lane::bytes("a") < Lane::bytes("b") && Lane::int(i64::MAX) < Lane::bytes(""));
        // Integers of any width that are equal are one lane.
        assert_eq!(5u8.lane_of(), 5i64.lane_of());
        assert_eq!("x".lane_of(), String::from("x").lane_of());
        // Fixed: a lane's slot does not depend on the process (no random keys).
        assert_eq!(Lane::int(1).slot(8), Lane::int(1).slot(8));
        assert_eq!(Lane::int(7).slot(1), 0);
        assert_eq!(Lane::int(7).slot(0), 0);
        // Forty consecutive accounts spread over eight slots, none left empty.
        let mut used = [0; 8];
        for account in 0..40i64 {
            used[Lane::int(account).slot(8)] += 1;
        }
        assert!(used.iter().all(|&n| n > 0), "{used:?}");
    }
}
