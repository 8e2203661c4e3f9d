//! Output: JSON for scripts, plain text (tab-separated columns) for people.

use serde::Serialize;

/// Prints `value` as JSON with `json`, else as `text` renders it.
pub fn print<T: Serialize>(value: &[T], json: bool, text: impl Fn(&[T]) -> String) {
    print_one(&value, json, |v: &&[T]| text(v));
}

/// Prints one `value` as JSON with `json`, else as `text` renders it.
pub fn print_one<T: Serialize>(value: &T, json: bool, text: impl Fn(&T) -> String) {
    if json {
        match serde_json::to_string_pretty(value) {
            Ok(s) => println!("{s}"),
            Err(e) => eprintln!("inbox: cannot render JSON: {e}"),
        }
    } else {
        print!("{}", text(value));
    }
}
