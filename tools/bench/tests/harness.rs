//! The harnesses run on every level this CPU has and report the rows the CLI prints (small
//! and quick: the numbers are not checked, only that every measurement happened).

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_bench::attention::{AttentionBenchOptions, Bound, run_attention_bench};
use kvstack_bench::codecs::{BenchOp, CodecBenchOptions, run_codec_bench};
use kvstack_kernels::{EntryFormat, SimdLevel, available_levels};

#[test]
fn the_codec_bench_measures_every_format_and_operation() {
    use BenchOp::*;
    use EntryFormat::*;
    for level in available_levels() {
        let opts = CodecBenchOptions {
            buffer_bytes: 1 << 16,
            repetitions: 1,
            level: Some(level),
            ..CodecBenchOptions::default()
        };
        let r = run_codec_bench(&opts);
        assert_eq!(r.level, level);
        let rows: Vec<(EntryFormat, BenchOp)> =
            r.results.iter().map(|x| (x.format, x.op)).collect();
        assert_eq!(
            rows,
            [
                (WindowFp8, Quantize),
                (WindowFp8, Dequantize),
                (GlobalFp4, Quantize),
                (GlobalFp4, Dequantize),
                (GlobalFp4, DotF32),
                (IndexMxfp4, Quantize),
                (IndexMxfp4, Dequantize),
                (IndexMxfp4, DotF32),
                (IndexMxfp4, DotMxfp4),
            ],
            "{level}"
        );
        assert!(
            r.results
                .iter()
                .all(|x| x.level == level && x.throughput.gb_per_s > 0.0 && x.ratio > 0.0),
            "{level}: {r}"
        );
        assert!(
            !r.notes.iter().any(|n| n.contains("failed")),
            "{level}: {r}"
        );
    }
}

#[test]
fn the_attention_bench_reports_every_case_and_part() {
    for level in available_levels() {
        let opts = AttentionBenchOptions {
            threads: vec![1, 2],
            repetitions: 1,
            level: Some(level),
            ..AttentionBenchOptions::quick()
        };
        let r = run_attention_bench(&opts).unwrap();
        assert_eq!(r.level, level);
        let limits: Vec<usize> = r.limits.iter().map(|l| l.threads).collect();
        assert_eq!(limits, [1, 2]);
        for l in &r.limits {
            assert!(
                l.read_gb_per_s > 0.0 && l.fma_gflop_per_s > 0.0,
                "{level}: {l:?}"
            );
            assert_eq!(
                l.int8_gflop_per_s > 0.0,
                level != SimdLevel::Portable,
                "{level}"
            );
        }
        let per_thread = [
            ("attention", "step"),
            ("reuse", "step"),
            ("reindex", "step"),
            ("reindex", "scan"),
            ("reindex", "read"),
            ("reindex", "select"),
            ("reindex", "attention"),
            ("full-131k", "step"),
            ("full-131k", "scan"),
            ("full-131k", "select"),
            ("plain-8k", "step"),
        ];
        let rows: Vec<(&str, &str, usize)> = r
            .results
            .iter()
            .map(|x| (x.case, x.part, x.threads))
            .collect();
        let want: Vec<(&str, &str, usize)> = [1, 2]
            .into_iter()
            .flat_map(|t| per_thread.map(|(c, p)| (c, p, t)))
            .collect();
        assert_eq!(rows, want, "{level}");
        for x in &r.results {
            assert!(x.ms > 0.0, "{level}: {x:?}");
            assert_eq!(x.bound == Bound::None, x.part == "select", "{level}: {x:?}");
        }
    }
}
