//! The driver's state machine against the fake controller.

use std::time::{Duration, Instant};

use kvstack_firmware_interface::nvme::{PAGE, Status, StatusCodeType, admin_opcode, nvm_opcode};

use super::fake::{Fake, FakeBar, FakeDma, Inject};
use super::*;

type Ctl = Controller<FakeBar, FakeDma>;

fn opts(entries: u16) -> ControllerOptions {
    ControllerOptions {
        io_queues: 2,
        io_queue_entries: entries,
        admin_queue_entries: 8,
        max_transfer: 4 << 20,
        command_timeout: Duration::from_millis(100),
        ..Default::default()
    }
}

fn up(fake: &Fake, entries: u16) -> Ctl {
    Controller::new(fake.bar(), fake.dma(), opts(entries)).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 12) as u8)
        .collect()
}

fn slice(region: &DmaRegion, offset: usize, len: usize) -> Option<DmaSlice> {
    Some(DmaSlice {
        region: region.clone(),
        offset,
        len,
    })
}

fn req(kind: IoKind, lba: u64, buf: Option<DmaSlice>, tag: u64) -> IoRequest {
    IoRequest {
        kind,
        lba,
        buf,
        tag,
    }
}

#[test]
fn bring_up_identifies_and_creates_the_granted_queues() {
    let fake = Fake::new(4096, 64);
    fake.state().max_io_queues = 1;
    let c = up(&fake, 16);
    let info = c.info().unwrap();
    assert_eq!(info.model, "kvstack fake ns");
    assert_eq!(info.serial, "FAKE0001");
    let ns = c.namespace().unwrap();
    assert_eq!((ns.size_blocks, ns.block_bytes()), (4096, 4096));
    // Two pairs asked for, one granted and created.
    assert_eq!(c.io_queues(), 1);
    assert_eq!(fake.io_queues(), 1);
    // MDTS 2^8 pages caps the 4 MiB asked for.
    assert_eq!(c.max_transfer(), 1 << 20);
    let log = fake.state().log.clone();
    let ops: Vec<u8> = log.iter().map(|&(_, op)| op).collect();
    assert_eq!(
        ops,
        [
            admin_opcode::IDENTIFY,
            admin_opcode::IDENTIFY,
            admin_opcode::SET_FEATURES,
            admin_opcode::CREATE_IO_CQ,
            admin_opcode::CREATE_IO_SQ
        ]
    );
}

#[test]
fn multi_page_writes_and_reads_round_trip_through_prp_lists() {
    let fake = Fake::new(4096, 64);
    fake.state().mdts = 0; // no limit: 600 pages need two chained PRP list pages
    let mut c = up(&fake, 16);
    assert_eq!(c.max_transfer(), 4 << 20);
    let buf = c.alloc(600 * PAGE).unwrap();
    let back = c.alloc(600 * PAGE).unwrap();
    let mut lba = 0;
    for (i, pages) in [1usize, 2, 3, 64, 512, 513, 600].into_iter().enumerate() {
        let data = pattern(i as u8, pages * PAGE);
        buf.volatile().write(0, &data).unwrap();
        c.run(req(IoKind::Write, lba, slice(&buf, 0, data.len()), 1))
            .unwrap();
        assert_eq!(
            fake.state().disk[lba as usize * PAGE..][..data.len()],
            data[..],
            "{pages} pages written"
        );
        c.run(req(IoKind::Read, lba, slice(&back, 0, data.len()), 2))
            .unwrap();
        let mut got = vec![0u8; data.len()];
        back.volatile().read(0, &mut got).unwrap();
        assert!(got == data, "{pages} pages read back");
        lba += pages as u64;
    }
    assert_eq!(fake.state().max_list_pages, 2);
    c.run(req(IoKind::Flush, 0, None, 3)).unwrap();
    assert_eq!(fake.state().flushes, 1);
}

#[test]
fn more_commands_than_the_queue_holds_wrap_the_rings() {
    let fake = Fake::new(256, 64);
    let mut c = up(&fake, 4);
    let buf = c.alloc(64 * PAGE).unwrap();
    for i in 0..64u8 {
        buf.volatile()
            .write(usize::from(i) * PAGE, &pattern(i, PAGE))
            .unwrap();
    }
    // 64 writes through a 4-entry queue (3 in flight at most), submitted as room allows.
    let mut out = Vec::new();
    let mut next = 0u64;
    let mut rounds = 0;
    while next < 64 || c.in_flight() > 0 {
        rounds += 1;
        assert!(rounds < 1000, "no progress");
        while next < 64 && c.has_room(0) {
            let off = next as usize * PAGE;
            c.submit(0, req(IoKind::Write, next, slice(&buf, off, PAGE), next))
                .unwrap();
            next += 1;
        }
        assert!(c.in_flight() <= 3);
        c.wait(1, &mut out).unwrap();
        if let Some(e) = out.iter().find_map(|c| c.result.as_ref().err()) {
            panic!("{e}");
        }
    }
    assert_eq!(out.len(), 64);
    let mut tags: Vec<u64> = out.iter().map(|c| c.tag).collect();
    tags.sort_unstable();
    assert_eq!(tags, (0..64).collect::<Vec<_>>());
    assert!(out.iter().all(|c| c.result.is_ok()));
    for i in 0..64usize {
        assert_eq!(
            fake.state().disk[i * PAGE..][..PAGE],
            pattern(i as u8, PAGE)[..]
        );
    }
    // 64 completions through 4 entries: the phase tag flipped 16 times, on both sides.
    assert_eq!(fake.state().cq_wraps.get(&1), Some(&16));
    // The admin queue (8 entries, 7 commands) never wrapped.
    assert_eq!(c.stats().wraps, 16);
    // A full queue refuses rather than overwrite.
    for i in 0..3 {
        c.submit(0, req(IoKind::Read, i, slice(&buf, 0, PAGE), i))
            .unwrap();
    }
    assert!(matches!(
        c.submit(0, req(IoKind::Read, 0, slice(&buf, 0, PAGE), 9)),
        Err(Error::NvmeQueueFull { queue: 1 })
    ));
}

#[test]
fn error_statuses_are_surfaced_with_their_names_and_the_queue_goes_on() {
    let fake = Fake::new(64, 64);
    let mut c = up(&fake, 8);
    let buf = c.alloc(PAGE).unwrap();
    fake.state().inject.push_back(Inject::Status(Status::new(
        StatusCodeType::MediaError,
        0x81,
    )));
    let err = c
        .run(req(IoKind::Read, 3, slice(&buf, 0, PAGE), 1))
        .unwrap_err();
    match &err {
        Error::NvmeCommand {
            command: "read",
            status,
        } => {
            assert_eq!(
                (status.code_type, status.code),
                (StatusCodeType::MediaError, 0x81)
            );
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("Unrecovered Read Error"), "{err}");
    assert_eq!(c.stats().errors, 1);
    c.run(req(IoKind::Read, 3, slice(&buf, 0, PAGE), 2))
        .unwrap();
}

#[test]
fn bad_requests_are_refused_before_reaching_the_device() {
    let fake = Fake::new(64, 64);
    let mut c = up(&fake, 8);
    let buf = c.alloc(4 * PAGE).unwrap();
    let commands = fake.state().log.len();
    let cases = [
        (req(IoKind::Read, 0, slice(&buf, 100, PAGE), 0), "whole"),
        (req(IoKind::Read, 0, slice(&buf, 0, 5 * PAGE), 0), "exceeds"),
        (
            req(IoKind::Write, 63, slice(&buf, 0, 2 * PAGE), 0),
            "outside",
        ),
        (
            req(IoKind::Write, u64::MAX, slice(&buf, 0, PAGE), 0),
            "outside",
        ),
        (req(IoKind::Read, 0, None, 0), "needs a buffer"),
        (req(IoKind::Flush, 0, slice(&buf, 0, PAGE), 0), "no buffer"),
    ];
    for (r, want) in cases {
        let err = c.submit(0, r).unwrap_err();
        assert!(err.to_string().contains(want), "{err}");
    }
    assert!(c.submit(5, req(IoKind::Flush, 0, None, 0)).is_err());
    // A freed region, and one from another controller's allocator, are not mapped here.
    let freed = c.alloc(PAGE).unwrap();
    c.free(freed.clone()).unwrap();
    let other = Fake::new(64, 64);
    let foreign = other.dma().alloc(PAGE).unwrap();
    for region in [&freed, &foreign] {
        let err = c
            .submit(0, req(IoKind::Read, 0, slice(region, 0, PAGE), 0))
            .unwrap_err();
        assert!(err.to_string().contains("not mapped"), "{err}");
    }
    assert_eq!(fake.state().log.len(), commands);
}

#[test]
fn a_command_that_never_completes_times_out_and_reset_recovers() {
    let fake = Fake::new(64, 64);
    let mut c = up(&fake, 8);
    let buf = c.alloc(2 * PAGE).unwrap();
    fake.state().inject.push_back(Inject::Swallow);
    c.submit(0, req(IoKind::Write, 0, slice(&buf, 0, PAGE), 7))
        .unwrap();
    c.submit(0, req(IoKind::Write, 1, slice(&buf, PAGE, PAGE), 8))
        .unwrap();
    let start = Instant::now();
    let mut out = Vec::new();
    c.wait(2, &mut out).unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    out.sort_by_key(|c| c.tag);
    // Tag 8 completed normally before the deadline; tag 7 timed out.
    assert!(out[1].result.is_ok());
    let err = out[0].result.as_ref().unwrap_err();
    assert!(matches!(err, Error::NvmeTimeout { .. }), "{err}");
    assert!(
        out[0].buf.is_some(),
        "the controller was disabled, so the buffer comes back"
    );
    assert_eq!(c.stats().timeouts, 1);
    // Failed until reset.
    let err = c.run(req(IoKind::Flush, 0, None, 0)).unwrap_err();
    assert!(matches!(err, Error::NvmeFailed { .. }), "{err}");
    c.reset().unwrap();
    assert_eq!(c.stats().bring_ups, 2);
    c.run(req(IoKind::Write, 2, slice(&buf, 0, PAGE), 9))
        .unwrap();
}

#[test]
fn malformed_completions_are_ignored_counted_and_time_out() {
    for inject in [Inject::WrongCid, Inject::BadSqid] {
        let fake = Fake::new(64, 64);
        let mut c = up(&fake, 8);
        let buf = c.alloc(PAGE).unwrap();
        fake.state().inject.push_back(inject);
        let err = c
            .run(req(IoKind::Read, 0, slice(&buf, 0, PAGE), 1))
            .unwrap_err();
        assert!(
            matches!(err, Error::NvmeTimeout { .. }),
            "{inject:?}: {err}"
        );
        assert_eq!(c.stats().malformed, 1, "{inject:?}");
        c.reset().unwrap();
        c.run(req(IoKind::Read, 0, slice(&buf, 0, PAGE), 2))
            .unwrap();
    }
}

#[test]
fn a_controller_that_stops_answering_neither_hangs_nor_panics() {
    let fake = Fake::new(64, 64);
    let mut c = up(&fake, 8);
    let buf = c.alloc(PAGE).unwrap();
    fake.state().dead = true;
    let start = Instant::now();
    let err = c
        .run(req(IoKind::Read, 0, slice(&buf, 0, PAGE), 1))
        .unwrap_err();
    assert!(matches!(err, Error::NvmeTimeout { .. }), "{err}");
    // The controller ignored CC.EN = 0 too: reset reports it instead of waiting forever.
    let err = c.reset().unwrap_err();
    assert!(err.to_string().contains("CSTS.RDY = 0"), "{err}");
    let mapped = fake.mapped();
    drop(c);
    // Shutdown and disable both time out (CAP.TO, 500 ms each); nothing is unmapped under a
    // device that may still write.
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(fake.mapped(), mapped);
}

#[test]
fn drop_deletes_queues_shuts_down_and_unmaps() {
    let fake = Fake::new(64, 64);
    let mut c = up(&fake, 8);
    let buf = c.alloc(PAGE).unwrap();
    c.run(req(IoKind::Write, 0, slice(&buf, 0, PAGE), 1))
        .unwrap();
    c.free(buf).unwrap();
    drop(c);
    let s = fake.state();
    assert_eq!(s.shutdowns, 1);
    let tail: Vec<u8> = s.log.iter().rev().take(4).map(|&(_, op)| op).collect();
    assert_eq!(
        tail,
        [
            admin_opcode::DELETE_IO_CQ,
            admin_opcode::DELETE_IO_SQ,
            admin_opcode::DELETE_IO_CQ,
            admin_opcode::DELETE_IO_SQ
        ]
    );
    assert!(
        s.log
            .iter()
            .any(|&(q, op)| q == 1 && op == nvm_opcode::WRITE)
    );
    drop(s);
    assert_eq!(fake.mapped(), 0);
}

#[test]
fn bring_up_failures_are_named() {
    // A controller that never becomes ready: CAP.TO (500 ms) bounds the wait.
    let fake = Fake::new(64, 64);
    fake.state().ready_delay = u32::MAX;
    let start = Instant::now();
    let err = Controller::new(fake.bar(), fake.dma(), opts(8)).unwrap_err();
    assert!(err.to_string().contains("CSTS.RDY = 1"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(3));
    assert_eq!(fake.mapped(), 0);

    let fake = Fake::new(64, 64);
    fake.state().inactive_namespace = true;
    let err = Controller::new(fake.bar(), fake.dma(), opts(8)).unwrap_err();
    let chain = format!(
        "{err}: {}",
        std::error::Error::source(&err)
            .map(|e| e.to_string())
            .unwrap_or_default()
    );
    assert!(chain.contains("NSZE"), "{chain}");

    let fake = Fake::new(64, 64);
    fake.state().cap.command_sets = 0;
    let err = Controller::new(fake.bar(), fake.dma(), opts(8)).unwrap_err();
    assert!(err.to_string().contains("NVM command set"), "{err}");

    let fake = Fake::new(64, 64);
    let err = Controller::new(
        fake.bar(),
        fake.dma(),
        ControllerOptions {
            namespace: 2,
            ..opts(8)
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("namespace 2"), "{err}");
}

#[test]
fn a_removed_device_is_reported_without_waiting() {
    let fake = Fake::new(64, 64);
    fake.state().removed = true;
    let err = Controller::new(fake.bar(), fake.dma(), opts(8)).unwrap_err();
    assert!(matches!(err, Error::NvmeRemoved), "{err}");

    let fake = Fake::new(64, 64);
    let mut c = up(&fake, 8);
    fake.state().removed = true;
    fake.state().dead = true;
    let start = Instant::now();
    let err = c.reset().unwrap_err();
    assert!(matches!(err, Error::NvmeRemoved), "{err}");
    let err = c.run(req(IoKind::Flush, 0, None, 0)).unwrap_err();
    assert!(err.to_string().contains("reset failed"), "{err}");
    drop(c);
    // No CAP.TO waits: every CSTS read says the device is gone.
    assert!(
        start.elapsed() < Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_failed_allocation_at_any_step_of_bring_up_leaves_nothing_mapped() {
    let fake = Fake::new(64, 64);
    drop(up(&fake, 8));
    let allocs = fake.state().allocs;
    // Admin SQ, CQ, Identify page; then SQ, CQ and PRP lists of each of two I/O pairs.
    assert_eq!(allocs, 9);
    for k in 0..allocs {
        let fake = Fake::new(64, 64);
        fake.state().fail_alloc = Some(k);
        assert!(
            Controller::new(fake.bar(), fake.dma(), opts(8)).is_err(),
            "{k}"
        );
        assert_eq!(fake.mapped(), 0, "allocation {k} failed");
    }
}

/// Host CPU per command of the driver plus the fake (which copies the data and walks the
/// PRPs): an upper bound on the driver's own cost per I/O. Prints a table; see docs/nvme.md.
#[test]
#[ignore = "measurement: cargo test -p kvstack-driver --lib nvme_per_command_cost -- --ignored --nocapture"]
fn nvme_per_command_cost() {
    let fake = Fake::new(4096, 1024);
    let mut c = Controller::new(
        fake.bar(),
        fake.dma(),
        ControllerOptions {
            io_queue_entries: 128,
            ..opts(128)
        },
    )
    .unwrap();
    let buf = c.alloc(64 * (128 << 10)).unwrap();
    println!("| transfer | queue depth | commands | us per command | MB/s |");
    for (bytes, depth) in [(4096usize, 1usize), (4096, 16), (4096, 64), (128 << 10, 16)] {
        let n = 20_000usize.min((256 << 20) / bytes);
        let mut out = Vec::new();
        let start = Instant::now();
        let (mut sent, mut done) = (0usize, 0usize);
        while done < n {
            while sent < n && sent - done < depth {
                let slot = sent % 64;
                let lba = ((sent * bytes / PAGE) % (4096 - bytes / PAGE)) as u64;
                c.submit(
                    0,
                    req(IoKind::Read, lba, slice(&buf, slot * (128 << 10), bytes), 0),
                )
                .unwrap();
                sent += 1;
            }
            out.clear();
            done += c.wait(1, &mut out).unwrap();
            assert!(out.iter().all(|c| c.result.is_ok()));
        }
        let t = start.elapsed().as_secs_f64();
        println!(
            "| {} KiB | {depth} | {n} | {:.2} | {:.0} |",
            bytes >> 10,
            t * 1e6 / n as f64,
            (n * bytes) as f64 / t / 1e6
        );
    }
}
