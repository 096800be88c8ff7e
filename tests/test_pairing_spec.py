"""docs/protocol.md's fingerprint (§1), invite string (§5.2) and worked key schedule (§5.2),
read from the document and checked two ways: against the spec's own formulas (hashlib,
hmac, HKDF, RFC 4648 base32) and against the node's code, so neither can drift."""
from __future__ import annotations

import base64
import hashlib
import hmac
import re
from pathlib import Path

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from psymesh.protocol import wordlist
from psymesh.protocol.identity import fingerprint, peer_fingerprint, peer_id_from_public_key
from psymesh.protocol.pairing import InviteTicket, PairingCode, _schedule, encode_invite, parse_invite
from psymesh.protocol.signing import canonical_encode

SPEC = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
PUBLIC = KEY.public_key().public_bytes_raw()
PEER = peer_id_from_public_key(PUBLIC)


def section(start: str, end: str) -> str:
    at = SPEC.index(start)
    return SPEC[at:SPEC.index(end, at)]


def block_bytes(text: str, marker: str) -> bytes:
    """The hex bytes and quoted strings of the first fenced block after `marker`, skipping
    gloss lines (those with no hex pair at their start)."""
    fence = text.index("```\n", text.index(marker)) + 4
    out = bytearray()
    for line in text[fence:text.index("```", fence)].splitlines():
        if not re.match(r"\s*[0-9a-f]{2}\b", line):
            continue
        for token in re.findall(r'"[^"]*"|\b[0-9a-f]{2}\b', line):
            out += token[1:-1].encode() if token.startswith('"') else bytes.fromhex(token)
    return bytes(out)


def hex_after(text: str, name: str) -> str:
    match = re.search(re.escape(name) + r"[^`]*?`?([0-9a-f]{32,})`", text)
    assert match, name
    return match.group(1)


# -- §1: the fingerprint ------------------------------------------------------------------------
def test_the_fingerprint_is_spelled_out_and_matches_the_code() -> None:
    text = section("**Fingerprint.**", "## 2. Frames")
    assert PEER in text and "`ABCDEFGHIJKLMNOPQRSTUVWXYZ234567`" in text
    assert PUBLIC.hex() == hex_after(text, "has public key")
    digest = hashlib.sha256(PUBLIC).digest()
    assert digest.hex() == hex_after(text, "whose SHA-256 is")
    b32 = base64.b32encode(digest).decode()
    assert f"`{b32[:16]}…`" in text
    by_the_words = "-".join(b32[i:i + 4] for i in range(0, 16, 4))
    assert f"so the fingerprint is `{by_the_words}`" in text
    assert fingerprint(PUBLIC) == peer_fingerprint(PEER) == by_the_words
    # §8's discovery example names a node's fingerprint too
    assert "That node's fingerprint, which `psymesh discover` shows beside it, is `" + \
        peer_fingerprint("12D3KooW9pP4Seg3kZYhySpuVjn1RPdQBsUFZKiFxGMGQN5MeL6A") + "`" in SPEC


# -- §5.2: the invite string --------------------------------------------------------------------------
def test_the_invite_string_example_is_what_the_node_writes_and_reads() -> None:
    text = section("*invite string*", "Let `J` and `I`")
    alphabet = re.search(r"lower case, `([a-z2-7]{32})`", text)
    assert alphabet and alphabet.group(1).upper() == "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
    blob = block_bytes(text, "The map is these 77 bytes:")
    assert len(blob) == 77
    code = PairingCode(nameplate=4817, words=("chisel", "molecule"))
    assert blob[blob.index(b"\xc4\x02") + 2:][:2] == bytes([wordlist.EVEN.index("chisel"), wordlist.ODD.index("molecule")]) == b"\x33\x94"
    from_words = canonical_encode({"a": ["/ip4/192.168.1.20/tcp/4001"], "c": [4817, b"\x33\x94"], "k": PUBLIC})
    assert blob == from_words
    invite = re.search(r"`(psymesh1:[a-z2-7]+)`", text)
    assert invite is not None
    string = invite.group(1)
    # RFC 4648 base32, lower case, unpadded: written from the spec's words
    assert string == "psymesh1:" + base64.b32encode(blob).decode().rstrip("=").lower()
    assert f"({len(string) - 9} base32 characters for 77 bytes)" in text
    ticket = InviteTicket(code=code, peer_id=PEER, addrs=("/ip4/192.168.1.20/tcp/4001",))
    assert encode_invite(ticket) == string
    # readers: upper case (a QR code's), `=` padding, a key they do not know
    body = string[len("psymesh1:"):]
    for variant in (string, "psymesh1:" + body.upper(), string.upper(), string + "=" * (-len(body) % 8)):
        assert parse_invite(variant) == ticket
    extra = msgpack.packb({"a": ["/ip4/192.168.1.20/tcp/4001"], "c": [4817, b"\x33\x94"], "k": PUBLIC, "z": 1})
    assert parse_invite("psymesh1:" + base64.b32encode(extra).decode().rstrip("=").lower()) == ticket


# -- §5.2: the key schedule ---------------------------------------------------------------------------------
def test_the_worked_key_schedule_follows_the_formulas_and_the_code() -> None:
    spake = section("**SPAKE2, byte by byte**", "**`info.role`**")
    text = section("**The key schedule, worked.**", "**`info.role`**")
    X = bytes.fromhex(hex_after(spake, "the joiner's\n`pake` is"))
    Y = bytes.fromhex(hex_after(spake, "the inviter's `pake`"))
    K = bytes.fromhex(hex_after(spake, "both sides get `K = "))
    transcript = block_bytes(text, "the transcript is the canonical msgpack array of 98 bytes:")
    assert transcript == canonical_encode(["/psymesh/pair/1.0.0", 4817, "J", "I", X, Y]) and len(transcript) == 98
    table = dict(re.findall(r"^\| `(\w+)`[^|]*\| `([0-9a-f]{64})` \|$", text, re.M))
    T = hashlib.sha256(transcript).digest()
    okm = HKDF(algorithm=hashes.SHA256(), length=128, salt=T, info=b"psymesh/pair/v1").derive(K)
    by_the_words = {"T": T, "kJ": okm[:32], "kI": okm[32:64], "session": okm[64:96], "words": okm[96:],
                    "mac_J": hmac.digest(okm[:32], b"joiner" + T, "sha256"),
                    "mac_I": hmac.digest(okm[32:64], b"inviter" + T, "sha256")}
    assert table == {name: value.hex() for name, value in by_the_words.items()}
    keys = _schedule(K, 4817, "J", "I", X, Y)
    assert (keys.joiner_mac, keys.inviter_mac, keys.session_key) == (
        by_the_words["mac_J"], by_the_words["mac_I"], by_the_words["session"])
    words = wordlist.words_for(okm[96:100])
    assert keys.words == words
    assert f"`{' '.join(words)}`" in text and f"`{okm[96:100].hex(' ')}`" in text
