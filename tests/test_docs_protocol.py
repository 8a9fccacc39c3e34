"""docs/protocol.md, "Signing without metanode": what it tells an author in another language
(the key, the uid, the signing bytes, the shell example) gives the known-answer vectors. An
author of an external plugin in Node.js had to guess the seed's PKCS#8 wrapping and which JSON
serialiser is RFC 8785 for a claim's array; the page says so now, and these tests keep it true."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import nacl.signing
import pytest

from tests.helpers.vectors import load_vectors

PAGE = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text(encoding="utf-8")
SECTION = PAGE.split("### Signing without metanode", 1)[1].split("\n### ", 1)[0]
VECTORS = load_vectors("claims.json")


def arrays() -> list[list[Any]]:
    """Each vector's signed array, `["metanode-claim/1", uid, cid, key, value, ts]`."""
    return [
        ["metanode-claim/1", *(v["claim"][f] for f in ("uid", "cid", "key", "value", "ts"))]
        for v in VECTORS["vectors"]
    ]


def signing_bytes() -> list[bytes]:
    return [bytes.fromhex(v["signing_bytes_hex"]) for v in VECTORS["vectors"]]


def named(pattern: str) -> str:
    """The code the section names, its line breaks as spaces."""
    found = re.search(pattern, " ".join(SECTION.split()))
    assert found, pattern
    return found.group(1)


def needs(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (.ci/run installs it)")
    return path


def test_the_shell_example_signs_the_first_vector(tmp_path: Path) -> None:
    """The OpenSSL and coreutils lines, as written, print the first vector's public key and
    signature, from its seed and its signing bytes."""
    needs("openssl")
    [script] = re.findall(r"```sh\n(SEED=.*?)```", SECTION, re.S)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    public, sig = done.stdout.splitlines()
    [signer] = [s for s in VECTORS["signers"] if s["uid"] == VECTORS["vectors"][0]["claim"]["uid"]]
    assert f"SEED={signer['seed_hex']}\n" in script
    assert public.lower() == signer["public_key_hex"]
    assert sig == VECTORS["vectors"][0]["claim"]["sig"]
    assert f"# {sig}\n" in script  # the answer the page prints
    assert (tmp_path / "signing.json").read_bytes() == signing_bytes()[0]


def test_the_key_and_uid_rules_give_each_signer_of_the_vectors() -> None:
    """The PKCS#8 prefix the page gives is the one its shell example uses, and the uid is
    base58btc in the digits it writes out, of `ed 01` + the public key."""
    prefix = named(r"the 16 bytes `([0-9a-f]{32})`, then the seed")
    assert f"printf '{prefix}%s'" in SECTION
    digits = named(r"written in the digits `([1-9A-Za-z]{58})`")
    for signer in VECTORS["signers"]:
        public = nacl.signing.SigningKey(bytes.fromhex(signer["seed_hex"])).verify_key.encode()
        number, spelt = int.from_bytes(b"\xed\x01" + public, "big"), ""
        while number:
            number, digit = divmod(number, 58)
            spelt = digits[digit] + spelt
        assert "z" + spelt == signer["uid"]


def test_the_python_serialiser_it_names_gives_the_signing_bytes() -> None:
    """`json.dumps(array, ensure_ascii=False, separators=(",", ":"))`, as the page writes it,
    over every vector (a retraction's null, control characters, non-ASCII); Python's plain
    `json.dumps`, which it warns of, does not."""
    expression = named(r"Python's `(json\.dumps\(array, ensure_ascii=False, separators=[^`]*)`")
    made = [eval(expression, {"json": json, "array": a}).encode() for a in arrays()]
    assert made == signing_bytes()
    assert [json.dumps(a).encode() for a in arrays()] != signing_bytes()


# Another language's serialiser as the text names it, run over every vector's array: the
# program, the sentence naming it, and a script printing each array's bytes in hex (EXPR: the
# named expression)
SERIALISERS = {
    "javascript": (
        "node",
        r"JavaScript's `(JSON\.stringify\(array\))`",
        "const arrays = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "for (const array of arrays) console.log(Buffer.from(EXPR).toString('hex'));",
    ),
    "perl": (
        "perl",
        r"Perl's `(JSON::PP->new->utf8->canonical->encode\(\$array\))`",
        "use JSON::PP; local $/; my $arrays = JSON::PP->new->utf8->decode(<STDIN>);"
        'for my $array (@$arrays) { print unpack("H*", EXPR), "\\n" }',
    ),
}


@pytest.mark.parametrize("language", sorted(SERIALISERS))
def test_the_serialiser_it_names_in_another_language_gives_the_signing_bytes(
    language: str,
) -> None:
    program, sentence, script = SERIALISERS[language]
    expression = named(sentence)
    assert hex_lines(needs(program), script.replace("EXPR", expression)) == signing_bytes()


def hex_lines(program: str, script: str) -> list[bytes]:
    """What `program -e script` prints, a line of hex a vector's array, given the arrays as
    JSON on its input."""
    done = subprocess.run(
        [program, "-e", script],
        input=json.dumps(arrays()),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [bytes.fromhex(line) for line in done.stdout.split()]
