//! The one TLS setup of every channeld binary: rustls with the ring crypto provider. [`main`]
//! installs the provider for libraries that use the process default; drivers that hand a
//! client configuration to their platform library (rumqttc) build it with
//! [`client_config`].
//!
//! [`main`]: crate::main

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// Installs the process-wide rustls crypto provider (ring). [`main`](crate::main) calls it
/// first thing; call it yourself in tests that open TLS connections outside `main`. Calling
/// it again changes nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Why a TLS client configuration could not be built. Names the file, never a secret.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("{path}: {reason}")]
    CaFile { path: String, reason: String },
    #[error("the system has no usable CA certificates")]
    NoSystemRoots,
    #[error("TLS setup: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A rustls client configuration with the ring provider, trusting the PEM certificates in
/// `ca_file` or, without one, the system's roots.
pub fn client_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, TlsSetupError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let ca_error =
                |reason: String| TlsSetupError::CaFile { path: path.display().to_string(), reason };
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|err| ca_error(err.to_string()))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(ca_error("holds no usable certificate".into()));
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for err in &native.errors {
                tracing::warn!(error = %err, "could not load some system CA certificates");
            }
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                return Err(TlsSetupError::NoSystemRoots);
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_without_certificates_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let err = client_config(Some(&path)).unwrap_err();
        assert!(err.to_string().starts_with(&path.display().to_string()), "{err}");
        let missing = dir.path().join("absent.pem");
        assert!(matches!(client_config(Some(&missing)), Err(TlsSetupError::CaFile { .. })));
    }
}
