//! `kvstack codec encode|decode`: raw little-endian files in the layout of
//! `shared/vectors/codecs` (f32 rows in, one entry per row out, and back).

use std::path::{Path, PathBuf};

use kvstack_firmware_interface::EntryFormat;

use crate::error::CliError;

/// Most bytes of a codec input: it is held in memory with its output.
const MAX_INPUT_BYTES: u64 = 16 << 30;

fn read(path: &Path) -> Result<Vec<u8>, CliError> {
    let bytes = kvstack_spec::files::read_regular(path, MAX_INPUT_BYTES).map_err(|source| {
        CliError::Read {
            path: path.into(),
            source,
        }
    })?;
    if bytes.is_empty() {
        return Err(CliError::Empty { path: path.into() });
    }
    Ok(bytes)
}

fn check_size(path: &Path, size: usize, unit: String, unit_bytes: usize) -> Result<(), CliError> {
    if !size.is_multiple_of(unit_bytes) {
        return Err(CliError::FileSize {
            path: path.into(),
            size: size as u64,
            unit,
            unit_bytes,
        });
    }
    Ok(())
}

/// Writes `bytes` to a temporary file beside `path`, then renames it into place, so a failed
/// run never leaves a truncated output behind.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), CliError> {
    let mut tmp = PathBuf::from(path);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    tmp.set_file_name(format!(".{name}.kvstack-tmp-{}", std::process::id()));
    if let Err(source) = std::fs::write(&tmp, bytes) {
        let _ = std::fs::remove_file(&tmp);
        return Err(CliError::Write {
            path: path.into(),
            source,
        });
    }
    std::fs::rename(&tmp, path).map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        CliError::Write {
            path: path.into(),
            source,
        }
    })
}

/// Encodes f32 rows (`dim` values each) into entries.
pub fn encode(format: EntryFormat, input: &Path, output: &Path) -> Result<(), CliError> {
    let bytes = read(input)?;
    let row_bytes = format.dim() * 4;
    check_size(
        input,
        bytes.len(),
        format!("{}-value f32 rows", format.dim()),
        row_bytes,
    )?;
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let rows = values.len() / format.dim();
    let mut out = vec![0u8; rows * format.entry_bytes()];
    kvstack_kernels::quantize(format, &values, &mut out).map_err(|source| CliError::Codec {
        path: input.into(),
        source,
    })?;
    write_atomically(output, &out)?;
    log::info!(
        "encoded {rows} {format} rows: {} -> {}",
        input.display(),
        output.display()
    );
    Ok(())
}

/// Decodes entries back into f32 rows.
pub fn decode(format: EntryFormat, input: &Path, output: &Path) -> Result<(), CliError> {
    let bytes = read(input)?;
    check_size(
        input,
        bytes.len(),
        format!("{format} entries"),
        format.entry_bytes(),
    )?;
    let rows = bytes.len() / format.entry_bytes();
    let mut values = vec![0f32; rows * format.dim()];
    kvstack_kernels::dequantize(format, &bytes, &mut values).map_err(|source| CliError::Codec {
        path: input.into(),
        source,
    })?;
    let out: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_atomically(output, &out)?;
    log::info!(
        "decoded {rows} {format} entries: {} -> {}",
        input.display(),
        output.display()
    );
    Ok(())
}
