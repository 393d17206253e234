//! TLS material from PEM files, read one way for the gateway and the worker: a server's
//! certificate chain and key (optionally requiring client certificates signed by a CA: mTLS), and
//! a client's trust (a CA file, else the platform's roots) and optional client certificate.
//!
//! rustls with the *ring* provider, passed explicitly (no process-wide default is installed
//! here); TLS 1.2 and 1.3; ALPN `http/1.1` (neither side speaks HTTP/2).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

pub use rustls;

/// What can go wrong reading TLS material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("{what} {path}: {reason}")]
    File {
        /// `certificate`, `private key` or `CA`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The material is readable but rustls refuses it (key does not match, bad CA, ...).
    #[error("TLS configuration: {reason}")]
    Config {
        /// rustls' reason.
        reason: String,
    },
}

type Result<T> = std::result::Result<T, TlsError>;

fn file_err(what: &'static str, path: &Path, reason: impl ToString) -> TlsError {
    TlsError::File {
        what,
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

fn config_err(e: impl ToString) -> TlsError {
    TlsError::Config {
        reason: e.to_string(),
    }
}

/// The crypto provider every config here uses.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate of a PEM file (leaf first for a chain); at least one.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let what = "certificate";
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_err(what, path, e))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| file_err(what, path, e))?;
    if certs.is_empty() {
        return Err(file_err(what, path, "no CERTIFICATE block"));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 RSA or SEC1 EC).
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| file_err("private key", path, e))
}

fn roots(path: &Path) -> Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    for c in certificates(path).map_err(|e| match e {
        TlsError::File { path, reason, .. } => TlsError::File {
            what: "CA",
            path,
            reason,
        },
        other => other,
    })? {
        store.add(c).map_err(|e| file_err("CA", path, e))?;
    }
    Ok(store)
}

/// A verifier that admits only clients with a certificate signed by the CA in `ca` (PEM).
pub fn client_verifier(ca: &Path) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>> {
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
        .build()
        .map_err(config_err)
}

/// A TLS listener's material.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTls {
    /// The certificate chain (PEM, leaf first).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// When set, every client must present a certificate signed by this CA (PEM): mTLS.
    pub client_ca: Option<PathBuf>,
}

impl ServerTls {
    /// The rustls server config (files read now; a bad file is an error here, not at the first
    /// handshake).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>> {
        let certs = certificates(&self.cert)?;
        let key = private_key(&self.key)?;
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(config_err)?;
        let builder = match &self.client_ca {
            Some(ca) => builder.with_client_cert_verifier(client_verifier(ca)?),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(certs, key).map_err(config_err)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// A client certificate and its key (PEM files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The certificate chain (leaf first).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

impl Identity {
    /// The chain and key as DER (for TLS stacks that take raw bytes, e.g. pingora's `CertKey`).
    pub fn der(&self) -> Result<(Vec<Vec<u8>>, Vec<u8>)> {
        let certs = certificates(&self.cert)?
            .into_iter()
            .map(|c| c.as_ref().to_vec())
            .collect();
        let key = private_key(&self.key)?.secret_der().to_vec();
        Ok((certs, key))
    }
}

/// How a client trusts servers and, optionally, proves who it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// Trust only this CA (PEM); `None`: the platform's roots.
    pub ca: Option<PathBuf>,
    /// A client certificate for servers that require one (mTLS).
    pub identity: Option<Identity>,
}

impl ClientTls {
    /// The rustls client config. Without a CA file the platform's roots are not loaded here
    /// (`None` is returned for the caller's own default trust).
    pub fn client_config(&self) -> Result<Option<ClientConfig>> {
        let Some(ca) = &self.ca else {
            if self.identity.is_some() {
                return Err(config_err(
                    "a client certificate needs a CA file to trust the servers it is shown to",
                ));
            }
            return Ok(None);
        };
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(config_err)?
            .with_root_certificates(roots(ca)?);
        let mut config = match &self.identity {
            Some(id) => builder
                .with_client_auth_cert(certificates(&id.cert)?, private_key(&id.key)?)
                .map_err(config_err)?,
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn reads_generated_material_and_refuses_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".into()])
            .unwrap()
            .signed_by(&leaf_key, &ca, &ca_key)
            .unwrap();
        let ca_pem = write(dir.path(), "ca.pem", &ca.pem());
        let cert = write(dir.path(), "leaf.pem", &leaf.pem());
        let key = write(dir.path(), "leaf.key", &leaf_key.serialize_pem());
        let server = ServerTls {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: Some(ca_pem.clone()),
        };
        let cfg = server.server_config().unwrap();
        assert_eq!(cfg.alpn_protocols, vec![b"http/1.1".to_vec()]);
        let client = ClientTls {
            ca: Some(ca_pem.clone()),
            identity: Some(Identity {
                cert: cert.clone(),
                key: key.clone(),
            }),
        };
        assert!(client.client_config().unwrap().is_some());
        let (chain, der) = client.identity.as_ref().unwrap().der().unwrap();
        assert_eq!(chain.len(), 1);
        assert!(!der.is_empty());
        assert!(ClientTls::default().client_config().unwrap().is_none());

        // Missing, empty and mismatched files are errors naming the file.
        let missing = dir.path().join("nope.pem");
        let e = ServerTls {
            cert: missing.clone(),
            key: key.clone(),
            client_ca: None,
        }
        .server_config()
        .unwrap_err();
        assert!(e.to_string().contains("nope.pem"), "{e}");
        let empty = write(dir.path(), "empty.pem", "");
        let e = certificates(&empty).unwrap_err();
        assert!(e.to_string().contains("no CERTIFICATE"), "{e}");
        let e = ServerTls {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: Some(empty),
        }
        .server_config()
        .unwrap_err();
        assert!(e.to_string().starts_with("CA "), "{e}");
        let other_key = write(
            dir.path(),
            "other.key",
            &rcgen::KeyPair::generate().unwrap().serialize_pem(),
        );
        let e = ServerTls {
            cert,
            key: other_key,
            client_ca: None,
        }
        .server_config()
        .unwrap_err();
        assert!(matches!(e, TlsError::Config { .. }), "{e}");
        // A client certificate without a CA to trust is refused.
        let e = ClientTls {
            ca: None,
            identity: Some(Identity {
                cert: key.clone(),
                key,
            }),
        }
        .client_config()
        .unwrap_err();
        assert!(e.to_string().contains("needs a CA"), "{e}");
    }
}
