"""One signing helper (protocol/signing.py) over one canonical encoding, for every signed
kind: grants, revocation notices, mail keys, letters, exit keys, address records.

The bytes each kind signs must not change with the helper: every signature already held
(grants in SQLite, letters in outboxes and inboxes) stays valid. So each kind's signing
bytes are checked against the encoder it had before (copied here as it was, the only
place the old code lives on), and the signatures against vectors made by the old code
with fixed keys (Ed25519 is deterministic)."""
from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from psymesh.protocol.addresses import AddrRecord
from psymesh.protocol.identity import peer_id_from_public_key
from psymesh.protocol.limits import Limits
from psymesh.protocol.mailbox import MailKey
from psymesh.protocol.manifest import Manifest, ManifestRevoke, parse_capability
from psymesh.protocol.messaging import Letter
from psymesh.protocol.oblivious import ExitKey
from psymesh.protocol.signing import Signed, canonical_encode

A = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
B = Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64)))
PA = peer_id_from_public_key(A.public_key().public_bytes_raw())
PB = peer_id_from_public_key(B.public_key().public_bytes_raw())


# -- the two encoders as they were (protocol/manifest.py and protocol/messaging.py) -------
def old_canonical(obj: Any) -> Any:  # manifest.canonical_encode: sorted keys, floats refused
    if isinstance(obj, dict):
        return {key: old_canonical(obj[key]) for key in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [old_canonical(item) for item in obj]
    if isinstance(obj, float):
        raise TypeError("floats")
    return obj


def old_sorted(obj: Any) -> Any:  # messaging._sorted: sorted keys, floats as float64
    if isinstance(obj, dict):
        return {key: old_sorted(obj[key]) for key in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [old_sorted(item) for item in obj]
    return obj


def old_signing_bytes(name: str, m: Any) -> bytes:
    """Each kind's `signing_bytes()` as it was written by hand before the helper."""
    pack = lambda o: msgpack.packb(old_canonical(o), use_bin_type=True)  # noqa: E731
    if name.startswith("manifest"):
        return b"psymesh/manifest/v1\x00" + pack(m.model_dump(mode="python", exclude={"signature"}, exclude_none=True))
    if name == "revoke":
        return b"psymesh/revoke/v1\x00" + pack({"issuer": m.issuer, "subject": m.subject, "serial": m.serial, "at": m.at})
    if name.startswith("mailkey"):
        return b"psymesh/mailkey/v1\x00" + pack(m.model_dump(mode="python", exclude={"signature"}, exclude_none=True))
    if name.startswith("letter"):
        return b"psymesh/letter/v1\x00" + msgpack.packb(
            old_sorted(m.model_dump(mode="python", exclude={"signature"}, exclude_none=True)), use_bin_type=True)
    if name == "exitkey":
        return b"psymesh/web-key/v1\x00" + pack(m.model_dump(mode="python", exclude={"signature"}))
    assert name == "addrs"
    return b"psymesh/addrs/v1\x00" + pack({"peer_id": m.peer_id, "addrs": list(m.addrs), "seq": m.seq})


SAMPLES: dict[str, Signed] = {
    "manifest": Manifest(issuer=PA, subject=PB, capabilities=(parse_capability("task.infer"), parse_capability("web.fetch")),
                         limits=Limits(requests_per_minute=60), not_before=1_800_000_000, expires=None, serial=7),
    "manifest_full": Manifest(issuer=PA, subject=PB, capabilities=(
        parse_capability("task.infer:models=qwen*,max_tokens=512"), parse_capability("web.fetch:domains=*.example.com")),
        limits=Limits(concurrent_tasks=2, max_runtime_s=60), not_before=10, expires=20, serial=1),
    "revoke": ManifestRevoke(issuer=PA, subject=PB, serial=7, at=1_800_000_100),
    "mailkey": MailKey(owner=PA, public=bytes(32), mailbox=None, serial=1_800_000_000_000),
    "mailkey_box": MailKey(owner=PA, public=bytes(range(32)), mailbox=PB, serial=5),
    "letter": Letter(id="l1", sender=PA, recipient=PB, thread="main", tseq=1, text="hello",
                     body={"z": 1.5, "a": [None, {"y": None, "b": 2}], "n": None}, at=1_800_000_000_000),
    "letter_stub": Letter(id="l2", sender=PA, recipient=PB, thread="t", tseq=2, at=5, withdrawn=True, group="g"),
    "letter_ask": Letter(id="q", sender=PA, recipient=PB, tseq=3, kind="ask", text="?", reply_to="l1",
                         body={"params": {"max_steps": 4, "temperature": 0.25}}, at=7),
    "exitkey": ExitKey(exit=PA, key_id=1, kem_id=0x20, kdf_id=1, aead_id=3, public_key=bytes(32), not_after=1_900_000_000),
    "addrs": AddrRecord(peer_id=PA, addrs=(f"/ip4/127.0.0.1/tcp/4001/p2p/{PA}",), seq=1_800_000_000_000),
}

# Made by the hand-written sign() of each kind before the helper (commit 4b1381e):
# sha256(signing bytes), signature.
VECTORS = {
    "manifest": ("df0cc11717ffc31bd72b332436065e8fb618e86c4339286e15c27c5d22271a6b",
        "a564d78434a3e56b498542a3243dc4643e653393c9c49af71175210e6f285ee40614c8dc09b16ab2fcbe0b4e9260a40acfc0694763e80232a7d3284984c7980c"),
    "revoke": ("5d2e494fa8c8cc8c2804c45ba5898bdce3b787171e2c4a03185178e742d1bc97",
        "a84eb9a80298813b79385171958f5ca973b4704e1ed4831e25f0569934af0041bb027e64207128c73e5781bd9c0a2c0db42a8be0f5f2ef5976caa61c12ea4d07"),
    "mailkey": ("a0017c9306fe87b7bd769ce5445a4c08343e2db41c0cfbbfa8d3c7cee632af8d",
        "ee2990cf22fa9b3b7edf454efa69e89e151c662e2f4df19a35d689879aeb8a871badc1ca08bdbdf1950ee99ec29e9a4d0cbcd9816b824950ad0e92919ae15305"),
    "mailkey_box": ("101b240cc5fadf820d19d681c27e7957eccf228bd7faf022bdf4b6c5158b6eaa",
        "f13f9016a84d870a8663c56d6e20e6a94ce6816b550a6d3ef88eaf5ed66b12ef133ab6605908dafe1c6554cee70cd781a3c5a7b2418dae3db57174e19ccc5a02"),
    "letter": ("a5801cbff54ba674af72f24621ab834b6f46349c11e739fdb4a9d360fd0f0bd7",
        "51bfc81b1fcd32ace6653311780e8e25c68f71d5fedc2d43794008a478348c94efa085bc2e1aeff29895fed9e6d19f642bbf360ec0675e8375210768fbd43b0d"),
    "letter_stub": ("8c290a8348827ea8d1498d9c183ba3ce44f8241fd116f4f6c2ed3404cd054a71",
        "94ff1583369c85fcc6bb647c20719ec1810e8dadd607bb4716562cce3a1f444d3d51376f59a5d6400c7bf8f50e671f3e1505ec93283b4f3d31d9e67e4d3f9300"),
    "exitkey": ("0f580406e9c6493a65caf8c46c198cf917cef921452c1b33caa6aad8a8869b82",
        "122149d80d2b8e3b90c652399cd69229d3d80704c78d8f8a910de5ad0c5995bbbd75829db678f904a52e2228bea485b32129970a2c48adf5f37421b98db1d50d"),
    "addrs": ("78130f167f252ce8c30765e3fa0bf5d1a661fdf078104dd1ab89497dbd9f4f53",
        "0c7640f852792dd262cb4fb7d7d91d87d9968ba38cbae85098b7f5b7d5278f2ced45bb0afa7dfa69ead6560274a13c565fb472fc1f245fc90b30e0283f79bd02"),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_kind_signs_the_bytes_its_old_encoder_gave(name: str) -> None:
    message = SAMPLES[name]
    assert message.signing_bytes() == old_signing_bytes(name, message)
    signed = message.sign(A)
    assert signed.signature_valid() and signed.signing_bytes() == message.signing_bytes()


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_signatures_made_before_the_helper_still_verify(name: str) -> None:
    digest, signature = VECTORS[name]
    message = SAMPLES[name]
    assert hashlib.sha256(message.signing_bytes()).hexdigest() == digest
    held = message.model_copy(update={"signature": bytes.fromhex(signature)})  # as stored before
    assert held.signature_valid() and message.sign(A).signature.hex() == signature


def test_a_wrong_key_or_a_changed_field_fails() -> None:
    for name, message in SAMPLES.items():
        with pytest.raises(ValueError, match="signing key is not the"):
            message.sign(B)
        signed = message.sign(A)
        forged = signed.model_copy(update={"signature": B.sign(signed.signing_bytes())})
        assert not forged.signature_valid(), name
    letter = SAMPLES["letter"].sign(A)
    assert not letter.model_copy(update={"text": "hellO"}).signature_valid()


def test_one_canonical_encoding_floats_only_where_allowed() -> None:
    assert canonical_encode({"b": 1, "a": [{"y": 2, "x": 3}]}) == bytes.fromhex("82a16191 82a17803a17902 a16201".replace(" ", ""))
    with pytest.raises(TypeError):
        canonical_encode({"t": 1.5})
    assert canonical_encode({"t": 1.5}, floats=True) == bytes.fromhex("81a174cb3ff8000000000000")
