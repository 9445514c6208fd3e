//! `channelctl acecode-manifest FAMILY DIR`: writes the `channel-platform.json` that lets
//! ACECode run a channeld driver binary as a channel platform plugin (`--acecode`), and
//! checks it with the same rules ACECode (and `channeld-acecode`) apply.

use std::path::{Path, PathBuf};

use channeld_protocol::acecode::{MANIFEST_FILE, Manifest, driver_manifest, valid_platform_name};

#[derive(Debug, thiserror::Error)]
pub(crate) enum ManifestWriteError {
    #[error("family {0:?} is not a platform name (^[a-z][a-z0-9-]{{1,31}}$)")]
    Family(String),
    #[error("cannot find the driver binary {0}: pass --binary")]
    NoBinary(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("the written manifest would be invalid: {0}")]
    Invalid(#[from] channeld_protocol::acecode::ManifestError),
}

/// Writes `dir/channel-platform.json` for `channeld-<family>` and returns its path.
pub(crate) fn write(
    family: &str,
    dir: &Path,
    binary: Option<&Path>,
) -> Result<PathBuf, ManifestWriteError> {
    if !valid_platform_name(family) {
        return Err(ManifestWriteError::Family(family.to_owned()));
    }
    let name = format!("channeld-{family}");
    let binary = match binary {
        Some(binary) => binary.to_path_buf(),
        None => std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join(&name)))
            .filter(|path| path.is_file())
            .ok_or_else(|| ManifestWriteError::NoBinary(name.clone()))?,
    };
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| ManifestWriteError::Io { path, source }
    };
    let binary = std::fs::canonicalize(&binary).map_err(io(&binary))?;
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let dir = std::fs::canonicalize(dir).map_err(io(dir))?;
    let label = format!("channeld {family}");
    let text = serde_json::to_string_pretty(&driver_manifest(family, &label, &binary))
        .expect("a JSON value serialises");
    Manifest::validate(&text, &dir, Path::is_file)?;
    let path = dir.join(MANIFEST_FILE);
    std::fs::write(&path, format!("{text}\n")).map_err(io(&path))?;
    Ok(path)
}
