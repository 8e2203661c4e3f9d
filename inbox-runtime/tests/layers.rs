//! The runtime's layers, checked: ARCHITECTURE.md lists them in order ("## Layers"), and every
//! `crate::` path in `src/` must name a module of the same layer or a lower one, with no circle
//! among the modules of one layer. A failure names the file, the import and the two layers.
//!
//! Reads files only: no database, no NATS.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One layer of ARCHITECTURE.md: its number (from 1, lowest first), its name, its modules.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layer {
    number: usize,
    name: String,
    modules: Vec<String>,
}

/// The layers listed under "## Layers": lines `N. **name** (`a`, `b`): what they hold`.
fn layers(architecture: &str) -> Result<Vec<Layer>, String> {
    let section = architecture
        .split("\n## ")
        .find(|s| s.starts_with("Layers"))
        .ok_or("ARCHITECTURE.md has no \"## Layers\" section")?;
    let mut layers = Vec::new();
    for line in section.lines() {
        let Some((number, rest)) = line.split_once(". **") else {
            continue;
        };
        let Ok(number) = number.trim().parse::<usize>() else {
            continue;
        };
        let (name, rest) = rest
            .split_once("**")
            .ok_or_else(|| format!("layer {number}: no closing ** after its name"))?;
        let list = rest
            .trim_start()
            .strip_prefix('(')
            .and_then(|r| r.split_once(')'))
            .map(|(list, _)| list)
            .ok_or_else(|| format!("layer {number} ({name}): no (`module`, ...) list"))?;
        let modules = list
            .split(',')
            .map(|m| m.trim().trim_matches('`').to_owned())
            .collect();
        layers.push(Layer {
            number,
            name: name.to_owned(),
            modules,
        });
    }
    if layers.is_empty() {
        return Err("ARCHITECTURE.md lists no layers under \"## Layers\"".into());
    }
    for (i, layer) in layers.iter().enumerate() {
        if layer.number != i + 1 {
            return Err(format!(
                "ARCHITECTURE.md: layer {} is listed as number {}",
                i + 1,
                layer.number
            ));
        }
    }
    Ok(layers)
}

/// `text` without comments (line comments, doc comments, block comments), string literals (raw
/// ones included) and char literals, so that a doc link such as [`Inbox`](crate::Inbox) or a
/// path in a message is not an import, and a `'"'` does not hide the code after it.
fn code_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut last = ' ';
    while let Some(c) = chars.next() {
        let word_before = last.is_ascii_alphanumeric() || last == '_';
        last = c;
        match c {
            // A raw string: r"..", r#".."#; not the end of a word such as `for`.
            'r' if !word_before && matches!(chars.peek(), Some('"' | '#')) => {
                let mut hashes = 0;
                while chars.peek() == Some(&'#') {
                    chars.next();
                    hashes += 1;
                }
                if chars.next() != Some('"') {
                    // `r#ident`, a raw identifier: keep the word.
                    out.push('r');
                    continue;
                }
                let mut closing = 0;
                for c in chars.by_ref() {
                    match (closing, c) {
                        (_, '"') => closing = 1,
                        (n, '#') if n > 0 => closing += 1,
                        _ => closing = 0,
                    }
                    if closing == hashes + 1 {
                        break;
                    }
                }
                out.push_str("\"\"");
                last = '"';
            }
            // A char literal ('x', '\n', '"'); a lifetime ('a) has no closing quote.
            '\'' => {
                let mut ahead = chars.clone();
                match (ahead.next(), ahead.next()) {
                    (Some('\\'), _) => {
                        chars.next();
                        chars.next();
                        for c in chars.by_ref() {
                            if c == '\'' {
                                break;
                            }
                        }
                        out.push_str("' '");
                    }
                    (Some(_), Some('\'')) => {
                        chars.next();
                        chars.next();
                        out.push_str("' '");
                    }
                    _ => out.push(c),
                }
            }
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut last = ' ';
                for c in chars.by_ref() {
                    if last == '*' && c == '/' {
                        break;
                    }
                    last = c;
                }
            }
            '"' => {
                let mut escaped = false;
                for c in chars.by_ref() {
                    match (escaped, c) {
                        (false, '\\') => escaped = true,
                        (false, '"') => break,
                        _ => escaped = false,
                    }
                }
                out.push_str("\"\"");
            }
            _ => out.push(c),
        }
    }
    out
}

/// The first segment of every `crate::` path in `code`: `crate::store::Inbox` gives `store`,
/// `use crate::{a::X, b}` gives `a` and `b`.
fn crate_paths(code: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        // `$crate::` (a macro's) and `inbox_runtime::crate` do not count; a word ending in
        // "crate" (`my_crate::`) is not this crate.
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        if let Some(group) = rest.trim_start().strip_prefix('{') {
            // A group: its top-level items, nested groups skipped.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        found.push(ident(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            found.push(ident(&item));
        } else {
            found.push(ident(rest));
        }
    }
    found.retain(|s| !s.is_empty() && s != "self");
    found
}

/// The source files under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {dir:?}: {e}"));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// The top-level module a file of `src` belongs to (`store/process.rs` is `store`), or `None`
/// for the crate root.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src).expect("a file under src");
    let first = relative.components().next()?.as_os_str().to_str()?;
    match first.strip_suffix(".rs") {
        Some("lib") => None,
        Some(stem) => Some(stem.to_owned()),
        None => Some(first.to_owned()),
    }
}

/// One `crate::` import of a module: which file, which module it is in, what it names.
#[derive(Debug, Clone)]
struct Import {
    file: String,
    from: String,
    to: String,
}

/// Everything wrong with `imports` against `layers`: an unknown or unlisted module, an import
/// through the crate root, an import that goes up a layer, a circle within a layer.
fn violations(layers: &[Layer], modules: &BTreeSet<String>, imports: &[Import]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut layer_of: BTreeMap<&str, &Layer> = BTreeMap::new();
    for layer in layers {
        for module in &layer.modules {
            if let Some(other) = layer_of.insert(module, layer) {
                problems.push(format!(
                    "module `{module}` is listed in layer {} ({}) and in layer {} ({})",
                    other.number, other.name, layer.number, layer.name
                ));
            }
            if !modules.contains(module) {
                problems.push(format!(
                    "layer {} ({}) lists `{module}`, which is no module of src/",
                    layer.number, layer.name
                ));
            }
        }
    }
    for module in modules {
        if !layer_of.contains_key(module.as_str()) {
            problems.push(format!(
                "module `{module}` is in no layer: add it to ARCHITECTURE.md's \"## Layers\""
            ));
        }
    }
    let mut edges: BTreeMap<&str, BTreeMap<&str, &str>> = BTreeMap::new();
    for import in imports {
        if import.from == import.to {
            continue;
        }
        let Some(to) = layer_of.get(import.to.as_str()) else {
            if !modules.contains(&import.to) {
                problems.push(format!(
                    "{} names `crate::{}` through the crate root: import it from its module",
                    import.file, import.to
                ));
            }
            continue;
        };
        let Some(from) = layer_of.get(import.from.as_str()) else {
            continue;
        };
        if to.number > from.number {
            problems.push(format!(
                "{} imports `crate::{}` (layer {}, {}) from `{}` (layer {}, {}): an import may only go to the same layer or a lower one",
                import.file, import.to, to.number, to.name, import.from, from.number, from.name
            ));
        } else if to.number == from.number {
            edges
                .entry(import.from.as_str())
                .or_default()
                .entry(import.to.as_str())
                .or_insert(import.file.as_str());
        }
    }
    problems.extend(circles(&edges));
    problems
}

/// Each circle among `edges` (module -> module -> a file that makes the import), once.
fn circles(edges: &BTreeMap<&str, BTreeMap<&str, &str>>) -> Vec<String> {
    fn walk<'a>(
        at: &'a str,
        edges: &BTreeMap<&'a str, BTreeMap<&'a str, &'a str>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
        found: &mut Vec<String>,
    ) {
        if let Some(start) = path.iter().position(|m| *m == at) {
            let circle = &path[start..];
            let steps: Vec<String> = circle
                .iter()
                .zip(circle.iter().skip(1).chain(std::iter::once(&at)))
                .map(|(a, b)| format!("`{a}` -> `{b}` ({})", edges[a][b]))
                .collect();
            found.push(format!("import circle: {}", steps.join(", ")));
            return;
        }
        if !done.insert(at) {
            return;
        }
        path.push(at);
        for next in edges.get(at).into_iter().flat_map(|e| e.keys()) {
            walk(next, edges, path, done, found);
        }
        path.pop();
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for start in edges.keys() {
        walk(start, edges, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

#[test]
fn every_import_goes_down_a_layer_or_stays_in_its_own_without_a_circle() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let architecture = crate_dir.join("../ARCHITECTURE.md");
    let architecture = std::fs::read_to_string(&architecture)
        .unwrap_or_else(|e| panic!("reading {architecture:?}: {e}"));
    let layers = layers(&architecture).unwrap_or_else(|e| panic!("{e}"));
    let src = crate_dir.join("src");
    let mut modules = BTreeSet::new();
    let mut imports = Vec::new();
    for file in rust_files(&src) {
        let Some(from) = module_of(&src, &file) else {
            continue;
        };
        modules.insert(from.clone());
        let text = std::fs::read_to_string(&file).expect("a source file");
        let name = file
            .strip_prefix(crate_dir)
            .unwrap_or(&file)
            .display()
            .to_string();
        for to in crate_paths(&code_of(&text)) {
            imports.push(Import {
                file: name.clone(),
                from: from.clone(),
                to,
            });
        }
    }
    assert!(
        imports.len() > 50,
        "found only {} crate:: imports: the scan is broken",
        imports.len()
    );
    let problems = violations(&layers, &modules, &imports);
    assert!(
        problems.is_empty(),
        "the runtime's layers (ARCHITECTURE.md, \"## Layers\") are broken:\n- {}",
        problems.join("\n- ")
    );
}

/// The checker itself, on a made-up crate: it must see what it is for.
mod checker {
    use super::*;

    const ARCHITECTURE: &str = "# A\n\n## Layers\n\n1. **core** (`error`, `key`): types.\n\
        2. **store** (`store`, `classify`): the table.\n3. **app** (`app`): the runner.\n\n## Next\n";

    fn import(from: &str, to: &str) -> Import {
        Import {
            file: format!("src/{from}.rs"),
            from: from.into(),
            to: to.into(),
        }
    }

    fn check(imports: &[Import]) -> Vec<String> {
        let layers = layers(ARCHITECTURE).unwrap();
        let modules = ["error", "key", "store", "classify", "app"]
            .map(String::from)
            .into();
        violations(&layers, &modules, imports)
    }

    #[test]
    fn the_layer_list_is_read_in_order() {
        let layers = layers(ARCHITECTURE).unwrap();
        assert_eq!(layers.len(), 3);
        assert_eq!(layers[1].name, "store");
        assert_eq!(layers[1].modules, ["store", "classify"]);
    }

    #[test]
    fn an_import_down_or_across_without_a_circle_passes() {
        let ok = [
            import("app", "store"),
            import("store", "classify"),
            import("classify", "error"),
        ];
        assert_eq!(check(&ok), Vec::<String>::new());
    }

    #[test]
    fn an_import_up_a_layer_is_named() {
        let problems = check(&[import("store", "app")]);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("src/store.rs imports `crate::app` (layer 3, app)"),
            "{problems:?}"
        );
    }

    #[test]
    fn a_circle_within_a_layer_is_named() {
        let problems = check(&[import("store", "classify"), import("classify", "store")]);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("import circle: `classify` -> `store`"));
    }

    #[test]
    fn an_import_through_the_crate_root_and_an_unlisted_module_are_named() {
        let problems = check(&[import("store", "Permanent")]);
        assert!(
            problems[0].contains("through the crate root"),
            "{problems:?}"
        );
        let layers = layers(ARCHITECTURE).unwrap();
        let modules = ["error", "key", "store", "classify", "app", "extra"]
            .map(String::from)
            .into();
        let problems = violations(&layers, &modules, &[]);
        assert!(
            problems[0].contains("`extra` is in no layer"),
            "{problems:?}"
        );
    }

    #[test]
    fn comments_strings_and_groups_are_read_as_rust_reads_them() {
        let code = code_of(
            "/// [`Inbox`](crate::Inbox)\nuse crate::{a::X, b, c::{d, e}};\n\
             let s = \"crate::nope\"; // crate::also_not\nf(crate::g::h); $crate::m; x_crate::n;",
        );
        assert_eq!(crate_paths(&code), ["a", "b", "c", "g"]);
    }

    #[test]
    fn char_literals_raw_strings_and_lifetimes_hide_no_code() {
        let code = code_of(
            "let q = '\"'; use crate::a;\nlet e = '\\''; use crate::b;\n\
             let r = r#\"x \" crate::nope \"#; use crate::c;\n\
             fn f<'x>(s: &'x str) -> char { 'y' }\nuse crate::d; let r#type = 1; crate::e::f();",
        );
        assert_eq!(crate_paths(&code), ["a", "b", "c", "d", "e"]);
    }
}
