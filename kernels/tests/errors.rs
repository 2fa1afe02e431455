//! Error paths: non-finite input names its row and column, wrong lengths name the buffer,
//! unavailable levels are refused.

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_kernels::*;

#[test]
fn non_finite_input_names_row_and_column() {
    for level in available_levels() {
        for format in EntryFormat::ALL {
            let dim = format.dim();
            for (bad, row, col) in [
                (f32::NAN, 2usize, 77usize),
                (f32::INFINITY, 0, 0),
                (f32::NEG_INFINITY, 3, dim - 1),
            ] {
                let mut x = vec![0.5f32; 4 * dim];
                x[row * dim + col] = bad;
                // A later bad value must not be the one reported.
                x[4 * dim - 1] = f32::NAN;
                if (row, col) == (3, dim - 1) {
                    x[4 * dim - 1] = bad;
                }
                let mut out = vec![0u8; 4 * format.entry_bytes()];
                let err = quantize_with(level, format, &x, &mut out).unwrap_err();
                match err {
                    Error::NonFinite {
                        row: r,
                        column: c,
                        value,
                    } => {
                        assert_eq!((r, c), (row, col), "{level} {format}");
                        assert_eq!(value.to_bits(), bad.to_bits());
                    }
                    other => panic!("{level} {format}: unexpected {other}"),
                }
                let msg = err.to_string();
                assert!(
                    msg.contains(&format!("row {row}")) && msg.contains(&format!("column {col}")),
                    "{msg}"
                );
                // As documented, the checked form has written what the unchecked form writes.
                let mut unchecked = vec![0u8; out.len()];
                quantize_unchecked_with(level, format, &x, &mut unchecked).unwrap();
                assert_eq!(out, unchecked, "{level} {format}");
            }
        }
    }
}

#[test]
fn wrong_lengths_are_rejected_and_output_is_untouched() {
    for format in EntryFormat::ALL {
        let dim = format.dim();
        let eb = format.entry_bytes();
        let x = vec![1.0f32; 2 * dim];

        let mut out = vec![0xEEu8; 2 * eb];
        let err = quantize(format, &x[..dim + 1], &mut out).unwrap_err();
        assert!(
            matches!(err, Error::NotAMultiple { multiple, actual, .. } if multiple == dim && actual == dim + 1),
            "{err}"
        );
        assert!(err.to_string().contains(format.name()), "{err}");
        assert!(out.iter().all(|&b| b == 0xEE));

        for n in [2 * eb - 1, 2 * eb + 1, eb] {
            let mut out = vec![0xEEu8; n];
            let err = quantize(format, &x, &mut out).unwrap_err();
            assert_eq!(
                err,
                Error::LengthMismatch {
                    what: match format {
                        EntryFormat::WindowFp8 => "fp8-window output bytes",
                        EntryFormat::GlobalFp4 => "fp4-global output bytes",
                        EntryFormat::IndexMxfp4 => "mxfp4-index output bytes",
                    },
                    expected: 2 * eb,
                    actual: n
                }
            );
            assert!(out.iter().all(|&b| b == 0xEE));
            let err = quantize_unchecked(format, &x, &mut out).unwrap_err();
            assert!(matches!(err, Error::LengthMismatch { .. }), "{err}");
        }

        let bytes = vec![0u8; 2 * eb];
        let mut y = vec![7f32; 2 * dim];
        let err = dequantize(format, &bytes[..eb + 3], &mut y).unwrap_err();
        assert!(
            matches!(err, Error::NotAMultiple { multiple, .. } if multiple == eb),
            "{err}"
        );
        let err = dequantize(format, &bytes, &mut y[..dim]).unwrap_err();
        assert!(
            matches!(err, Error::LengthMismatch { expected, actual, .. } if expected == 2 * dim && actual == dim),
            "{err}"
        );
        assert!(y.iter().all(|&v| v == 7.0));

        // Zero rows is fine.
        quantize(format, &[], &mut []).unwrap();
        dequantize(format, &[], &mut []).unwrap();
    }
}

#[test]
fn dot_batch_lengths_are_checked() {
    let q = [0f32; 512];
    let e = [GlobalFp4Entry {
        values: [0; 256],
        scales: [0x38; 32],
    }; 3];
    let mut out = [0f32; 2];
    let err = dot_fp4_many(&q, &e, &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            Error::LengthMismatch {
                expected: 3,
                actual: 2,
                ..
            }
        ),
        "{err}"
    );
    let k = [IndexMxfp4Entry {
        values: [0; 64],
        scales: [127; 4],
    }; 3];
    let q128 = [0f32; 128];
    assert!(dot_mxfp4_many(&q128, &k, &mut out).is_err());
    assert!(dot_mxfp4_mxfp4_many(&k[0], &k, &mut out).is_err());
    let mut out = [1f32; 3];
    dot_mxfp4_mxfp4_many(&k[0], &k, &mut out).unwrap();
    assert_eq!(out, [0.0; 3]);
}

#[test]
fn unavailable_levels_are_refused_by_every_with_function() {
    for level in SimdLevel::ALL {
        if level.is_available() {
            continue;
        }
        let check = |r: Result<(), Error>| match r {
            Err(Error::UnsupportedLevel { level: l, .. }) => assert_eq!(l, level),
            other => panic!("{level}: {other:?}"),
        };
        let f = EntryFormat::IndexMxfp4;
        check(quantize_with(level, f, &[0.0; 128], &mut [0; 68]));
        check(quantize_unchecked_with(level, f, &[0.0; 128], &mut [0; 68]));
        check(dequantize_with(level, f, &[0; 68], &mut [0.0; 128]));
        let k = IndexMxfp4Entry {
            values: [0; 64],
            scales: [127; 4],
        };
        check(dot_mxfp4_with(level, &[0.0; 128], &k).map(|_| ()));
        check(dot_mxfp4_mxfp4_with(level, &k, &k).map(|_| ()));
        check(dot_mxfp4_many_with(level, &[0.0; 128], &[k], &mut [0.0]));
        check(dot_mxfp4_mxfp4_many_with(level, &k, &[k], &mut [0.0]));
        let e = GlobalFp4Entry {
            values: [0; 256],
            scales: [0x38; 32],
        };
        check(dot_fp4_with(level, &[0.0; 512], &e).map(|_| ()));
        check(dot_fp4_many_with(level, &[0.0; 512], &[e], &mut [0.0]));
    }
}
