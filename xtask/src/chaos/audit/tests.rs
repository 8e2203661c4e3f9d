//! The audit on hand-made results: each way a message can end wrong is named, with the
//! message.

use super::*;
use crate::chaos::publish::Sent;

/// Two requests (r-0 on account 0, r-1 on account 1, each published twice), one poison, one
/// unopened credit and one unreadable request; sequences 1..=7.
fn published() -> Published {
    let mut by_seq = BTreeMap::new();
    let request = |i: i64, msg_id: bool| Sent {
        kind: Kind::Request,
        label: format!("r-{i}"),
        key: Some(format!("r-{i}")),
        account: Some(i),
        msg_id: msg_id.then(|| format!("r-{i}")),
        payload: format!("request {i}").into_bytes(),
        raw_headers: Vec::new(),
    };
    by_seq.insert(1, request(0, true));
    by_seq.insert(2, request(1, true));
    by_seq.insert(
        3,
        Sent {
            kind: Kind::Poison,
            label: "poison-0".into(),
            key: None,
            account: None,
            msg_id: None,
            payload: b"{ not json 0".to_vec(),
            raw_headers: Vec::new(),
        },
    );
    by_seq.insert(4, request(0, false));
    by_seq.insert(5, request(1, false));
    by_seq.insert(
        6,
        Sent {
            kind: Kind::Unopened,
            label: "u-0".into(),
            key: Some("u-0".into()),
            account: Some(9),
            msg_id: None,
            payload: b"unopened".to_vec(),
            raw_headers: Vec::new(),
        },
    );
    by_seq.insert(
        7,
        Sent {
            kind: Kind::Unreadable,
            label: "x-0".into(),
            key: Some("x-0".into()),
            account: Some(10),
            msg_id: None,
            payload: b"unreadable".to_vec(),
            raw_headers: vec![b"X-Bin: \xff".to_vec()],
        },
    );
    Published {
        by_seq,
        requests: 2,
        dead_expected: 3,
    }
}

fn letter(dlq_seq: u64, seq: u64, payload: &[u8], delivered: i64) -> Letter {
    Letter {
        dlq_seq,
        subject: DLQ_SUBJECT.into(),
        consumer: Some(CONSUMER.into()),
        stream: Some(STREAM.into()),
        stream_seq: Some(seq.to_string()),
        delivered: Some(delivered.to_string()),
        error: Some("boom".into()),
        msg_id: Some(format!("dlq:{CONSUMER}:{STREAM}:{seq}")),
        original_msg_id: None,
        unreadable_headers: None,
        payload: payload.to_vec(),
    }
}

/// The backstop's letter of the unreadable request (sequence 7), its header line carried.
fn backstop_letter(dlq_seq: u64) -> Letter {
    Letter {
        error: Some(
            "delivery limit reached without a verdict (delivery 10 of consumer \"credit\")".into(),
        ),
        unreadable_headers: Some("WC1CaW46IP8=".into()),
        ..letter(dlq_seq, 7, b"unreadable", MAX_DELIVER)
    }
}

/// Everything as it should be.
fn clean() -> Observed {
    Observed {
        markers: ["r-0", "r-1"].map(String::from).into(),
        open_markers: Vec::new(),
        balances: [(0, 1), (1, 1)].into(),
        stream_last_seq: 7,
        letters: vec![
            letter(1, 3, b"{ not json 0", 1),
            letter(2, 6, b"unopened", MAX_DELIVER),
            backstop_letter(3),
        ],
        events: vec![Ok(("r-0".into(), 0)), Ok(("r-1".into(), 1))],
        unsent_events: 0,
    }
}

fn problems(seen: &Observed) -> Vec<(Problem, Vec<String>)> {
    audit(&published(), seen).problems.into_iter().collect()
}

#[test]
fn a_clean_run_has_no_findings() {
    let f = audit(&published(), &clean());
    assert!(f.problems.is_empty(), "{:?}", f.problems);
    assert_eq!((f.applied_once, f.dead_once, f.announced_once), (2, 3, 2));
    assert_eq!(f.by_backstop, 1);
}

#[test]
fn a_missing_a_doubled_and_a_stray_announcement_are_named() {
    let mut seen = clean();
    seen.events = vec![
        Ok(("r-1".into(), 1)),
        Ok(("r-1".into(), 1)),
        Ok(("u-0".into(), 9)),
        Err("event #4 does not parse".into()),
    ];
    seen.unsent_events = 3;
    assert_eq!(
        problems(&seen),
        [
            (Problem::NotAnnounced, vec!["r-0".to_owned()]),
            (Problem::AnnouncedTwice, vec!["r-1 (2 events)".to_owned()]),
            (
                Problem::StrayEvent,
                vec![
                    "event #4 does not parse".to_owned(),
                    "u-0 (1 events)".to_owned()
                ]
            ),
            (Problem::Unsent, vec!["3 rows".to_owned()]),
        ]
    );
}

#[test]
fn a_lost_request_and_a_double_apply_are_named() {
    let mut seen = clean();
    seen.markers.remove("r-1");
    seen.balances.remove(&1);
    seen.balances.insert(0, 2);
    seen.events.truncate(1);
    assert_eq!(
        problems(&seen),
        [
            (
                Problem::Lost,
                vec!["r-1 (seq 2)".to_owned(), "r-1 (seq 5)".to_owned()]
            ),
            (Problem::AppliedTwice, vec!["r-0 (balance 2)".to_owned()]),
        ]
    );
}

#[test]
fn torn_requests_are_named() {
    let mut seen = clean();
    seen.markers.remove("r-0");
    seen.balances.remove(&1);
    seen.open_markers.push("r-9".into());
    seen.events.drain(..1);
    assert_eq!(
        problems(&seen),
        [
            (Problem::MarkerWithoutEffect, vec!["r-1".to_owned()]),
            (Problem::EffectWithoutMarker, vec!["r-0".to_owned()]),
            (Problem::OpenMarker, vec!["r-9".to_owned()]),
        ]
    );
}

#[test]
fn letters_are_matched_by_sequence_and_checked() {
    let mut seen = clean();
    // A second letter for the poison, a letter for a request's second copy, the unopened
    // credit's letter written before max_deliver, a letter whose payload is another's.
    seen.letters.push(letter(3, 3, b"{ not json 0", 2));
    seen.letters.push(letter(4, 5, b"request 1", 1));
    seen.letters[1].delivered = Some("3".into());
    seen.letters.push(letter(5, 4, b"{ not json 0", 1));
    assert_eq!(
        problems(&seen),
        [
            (Problem::DeadLetteredRequest, vec!["r-1".to_owned()]),
            (
                Problem::DeadLetteredTwice,
                vec!["poison-0 (2 letters)".to_owned()]
            ),
            (
                Problem::BeforeMaxDeliver,
                vec!["u-0 (delivery 3)".to_owned()]
            ),
            (
                Problem::StrayLetter,
                vec!["letter #5: payload is not that of r-0 (seq 4)".to_owned()]
            ),
        ]
    );
}

#[test]
fn a_missing_letter_an_applied_rejection_and_stray_rows_are_named() {
    let mut seen = clean();
    seen.letters.remove(0);
    seen.letters.remove(0);
    seen.letters.remove(0);
    seen.markers.insert("u-0".into());
    seen.markers.insert("ghost".into());
    seen.balances.insert(9, 1);
    seen.balances.insert(42, 1);
    assert_eq!(
        problems(&seen),
        [
            (
                Problem::Lost,
                vec!["poison-0 (seq 3)".to_owned(), "x-0 (seq 7)".to_owned()]
            ),
            (Problem::AppliedRejected, vec!["u-0".to_owned()]),
            (
                Problem::StrayRow,
                vec!["account 42".to_owned(), "marker ghost".to_owned()]
            ),
        ]
    );
}

#[test]
fn a_letter_must_name_its_original_everywhere() {
    let p = published();
    let ok = letter(1, 3, b"{ not json 0", 1);
    assert_eq!(origin(&ok, &p), Ok(3));
    let wrong = [
        Letter {
            consumer: Some("other".into()),
            ..ok.clone()
        },
        Letter {
            stream_seq: Some("77".into()),
            ..ok.clone()
        },
        Letter {
            msg_id: None,
            ..ok.clone()
        },
        Letter {
            original_msg_id: Some("x".into()),
            ..ok.clone()
        },
        Letter {
            error: None,
            ..ok.clone()
        },
        Letter {
            subject: "inbox.dlq.other".into(),
            ..ok.clone()
        },
    ];
    for letter in wrong {
        assert!(origin(&letter, &p).is_err(), "{letter:?}");
    }
    let first_copy = Letter {
        original_msg_id: Some("r-0".into()),
        ..letter(9, 1, b"request 0", 1)
    };
    assert_eq!(origin(&first_copy, &p), Ok(1));
}

#[test]
fn a_sequence_chaos_never_published_is_lost() {
    let mut seen = clean();
    seen.stream_last_seq = 8;
    assert_eq!(
        problems(&seen),
        [(
            Problem::Lost,
            vec!["seq 8 (not published by chaos)".to_owned()]
        )]
    );
}

#[test]
fn an_unreadable_message_s_letter_must_carry_its_header_lines() {
    let mut seen = clean();
    for carried in [
        None,
        Some("WC1CaW46IA=="),
        Some("not base64!"),
        Some("WC1CaW46IP8=,WC1CaW46IP8="),
    ] {
        seen.letters[2].unreadable_headers = carried.map(String::from);
        assert_eq!(
            problems(&seen),
            [(Problem::HeadersDropped, vec!["x-0 (letter #3)".to_owned()])],
            "{carried:?}"
        );
    }
}

#[test]
fn an_unopened_credit_may_be_dead_lettered_by_the_backstop() {
    let mut seen = clean();
    seen.letters[1] = Letter {
        error: backstop_letter(2).error,
        ..letter(2, 6, b"unopened", MAX_DELIVER)
    };
    let f = audit(&published(), &seen);
    assert!(f.problems.is_empty(), "{:?}", f.problems);
    assert_eq!((f.dead_once, f.by_backstop), (3, 2));
}
