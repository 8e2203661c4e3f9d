//! Fails the build when a file of `src/suite/` is not declared in `src/suite/mod.rs`: such a
//! file would never be compiled, and its behaviours would silently never run.

use std::fs;

fn main() {
    let dir = "src/suite";
    println!("cargo::rerun-if-changed={dir}");
    let list = fs::read_to_string(format!("{dir}/mod.rs")).expect("src/suite/mod.rs");
    let mut missing = Vec::new();
    for entry in fs::read_dir(dir).expect("src/suite") {
        let path = entry.expect("a directory entry").path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        let declared = list.lines().any(|l| l.trim() == format!("mod {stem};"));
        if path.extension().is_some_and(|e| e == "rs") && stem != "mod" && !declared {
            missing.push(stem.to_owned());
        }
    }
    assert!(
        missing.is_empty(),
        "src/suite/ files not declared in src/suite/mod.rs (add `mod <name>;` there and a \
         `super::behaviours!(..);` line in the file; see CONTRIBUTING.md): {missing:?}"
    );
}
