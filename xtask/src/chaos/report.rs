//! The one report of the credit runs (single server, cluster, failover): a table with a row per
//! run, the audit's columns first and the run's own faults after, then what failed. One printer,
//! so that the three runs read alike and a change to the audit's columns is made once.

use super::audit::Audited;
use comfy_table::{CellAlignment, Table, presets};

/// The columns of a run's table: which of the shared ones show, and the run's own.
pub struct Columns {
    /// The first column's header, each row's backend; none for a run on one database only.
    pub backend: Option<&'static str>,
    /// Whether the announcements column shows (what the single-server run checks the outbox by).
    pub announced: bool,
    /// The headers of the run's own columns, after the audit's.
    pub own: &'static [&'static str],
    /// Whether every column but the first is right-aligned.
    pub right_aligned: bool,
}

/// One run on one backend, audited.
pub struct Row {
    /// Its backend, the first cell when [`Columns::backend`] is set.
    pub backend: &'static str,
    /// What heads its findings when it failed.
    pub name: String,
    /// What the audit found.
    pub audited: Audited,
    /// The cells of the run's own columns.
    pub own: Vec<String>,
    /// What the run needed and did not get (a fault that did not bite proves nothing), one line
    /// each: any fails the run.
    pub missing: Vec<String>,
}

impl Row {
    /// Every message ended as it must, and the run tested what it set out to.
    pub fn ok(&self) -> bool {
        self.audited.exact() && self.missing.is_empty()
    }

    /// The row's cells, as `columns` says.
    fn cells(&self, columns: &Columns) -> Vec<String> {
        let a = &self.audited;
        let f = &a.findings;
        let (lost, twice, other) = f.tally();
        let mut cells = Vec::new();
        if columns.backend.is_some() {
            cells.push(self.backend.to_owned());
        }
        cells.push(a.total.to_string());
        cells.push(format!("{}/{}", f.applied_once, a.requests));
        if columns.announced {
            cells.push(format!("{}/{}", f.announced_once, a.requests));
        }
        cells.push(format!("{}/{}", f.dead_once, a.dead_expected));
        cells.push(f.by_backstop.to_string());
        cells.extend([lost.to_string(), twice.to_string(), other.to_string()]);
        cells.extend(self.own.iter().cloned());
        cells
    }
}

/// The runs of one kind, in the order they ran.
pub struct Report {
    /// Its table's columns.
    pub columns: Columns,
    /// A row per run.
    pub rows: Vec<Row>,
}

impl Report {
    /// Prints the table.
    pub fn print_table(&self) {
        let columns = &self.columns;
        let mut header: Vec<&str> = columns.backend.into_iter().collect();
        header.extend(["published", "applied once"]);
        if columns.announced {
            header.push("announced");
        }
        header.extend(["dead", "backstop", "lost", "twice", "other"]);
        header.extend(columns.own);
        let mut table = Table::new();
        table.load_preset(presets::UTF8_FULL_CONDENSED);
        table.set_header(header.clone());
        for row in &self.rows {
            table.add_row(row.cells(columns));
        }
        if columns.right_aligned {
            for column in 1..header.len() {
                if let Some(c) = table.column_mut(column) {
                    c.set_cell_alignment(CellAlignment::Right);
                }
            }
        }
        println!("{table}");
    }

    /// Prints, for each run that failed, its findings and what it missed.
    pub fn print_failures(&self) {
        for row in self.rows.iter().filter(|r| !r.ok()) {
            println!("\n{} FAILED:", row.name);
            row.audited.findings.print_problems();
            for missing in &row.missing {
                println!("  {missing}");
            }
        }
    }

    /// How many runs failed.
    pub fn failed(&self) -> usize {
        self.rows.iter().filter(|r| !r.ok()).count()
    }

    /// The duplicates each run's processes skipped, by backend: `postgres 12, sqlite 3`.
    pub fn skipped(&self) -> String {
        self.rows
            .iter()
            .map(|r| format!("{} {}", r.backend, r.audited.skipped))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
