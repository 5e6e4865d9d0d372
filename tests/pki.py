"""A throwaway private CA and certificates for TLS tests, made with the openssl command
(the `cryptography` package is not a dependency). EC P-256 keys: instant to generate.

`node` is what every Halfmoon process presents (server and client authentication, valid
for localhost and 127.0.0.1); `rogue` is the same kind of certificate from another CA.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_EXT = """basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


@dataclass(frozen=True)
class Pki:
    ca: str
    cert: str
    key: str
    rogue_ca: str
    rogue_cert: str
    rogue_key: str


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(folder: Path, name: str) -> tuple[Path, Path]:
    ca, key = folder / f"{name}-ca.pem", folder / f"{name}-ca.key"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        f"/CN=halfmoon test CA {name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return ca, key


def _leaf(folder: Path, name: str, ca: Path, ca_key: Path) -> tuple[Path, Path]:
    cert, key, csr = folder / f"{name}.pem", folder / f"{name}.key", folder / f"{name}.csr"
    ext = folder / f"{name}.ext"
    ext.write_text(_EXT)
    _openssl(
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        f"/CN={name}",
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    return cert, key


def make_pki(folder: Path) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca(folder, "cluster")
    cert, key = _leaf(folder, "node", ca, ca_key)
    rogue_ca, rogue_ca_key = _ca(folder, "rogue")
    rogue_cert, rogue_key = _leaf(folder, "rogue", rogue_ca, rogue_ca_key)
    return Pki(str(ca), str(cert), str(key), str(rogue_ca), str(rogue_cert), str(rogue_key))
