"""exstill-pack: make, inspect, verify and sign card images.

exstill-pack CHECKPOINT_DIR|MODEL.gguf -o IMAGE --target NAME [--dtype f32|f16|int8]
             [--sign-key KEY] [--head-ids FILE]
exstill-pack inspect IMAGE [--json]
exstill-pack verify IMAGE [--trusted-keys DIR|FILE] [--json]
exstill-pack sign IMAGE --key KEY [-o SIGNED_IMAGE] [--json]
exstill-pack keygen [--dir DIR] [--name NAME] [--json]

Two SHA-256 values name an image: ``content_sha256`` (everything before the trailer: what the
trailer records and a signature covers) and ``file_sha256`` (the whole file: what exstill-flash
and the card's image list show).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from exstill_sdk.cli.support import EXIT_OK, Parser, print_result, run

SUBCOMMANDS = ("inspect", "verify", "sign", "keygen")


def _pack_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="exstill-pack",
        description="Pack an HF checkpoint (Llama, Mistral, Qwen2, Qwen3; safetensors) or a GGUF "
        "file (llama, qwen2, qwen3; any quantisation, dequantised) into a card image. Other "
        "commands: exstill-pack {inspect,verify,sign,keygen} --help",
    )
    p.add_argument(
        "checkpoint",
        help="HF checkpoint directory (config.json, safetensors, tokenizer.json) or GGUF file",
    )
    p.add_argument("-o", "--output", required=True, help="image file to write")
    p.add_argument("--target", required=True, help="the target name streams will open")
    p.add_argument("--dtype", choices=["f32", "f16", "int8"], default="f32", help="matrix dtype")
    p.add_argument("--sign-key", help="Ed25519 private key (PEM) to sign the image with")
    p.add_argument("--tokenizer", help="the target's tokenizer.json, if the checkpoint has none")
    p.add_argument("--image-version", default="1", help="version string stored in the image")
    p.add_argument(
        "--head-ids",
        metavar="FILE",
        help="a frequency-ranked head: keep only these tokens' output rows (a JSON list of "
        "token ids, or one id a line; exstill distill writes one as head-ids.json)",
    )
    p.add_argument(
        "--rank-temperature",
        type=float,
        metavar="T",
        help="the temperature that calibrates the draft's probabilities, by which the card "
        "ranks tree nodes and outcomes to draft ahead for (exstill distill fits it; exstill "
        "eval reports it as rank_temperature_fit; default 0.5)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def _image_parser(command: str) -> argparse.ArgumentParser:
    p = Parser(prog=f"exstill-pack {command}")
    if command == "keygen":
        p.description = "Make an Ed25519 key pair for signing images: NAME.key and NAME.pub."
        p.add_argument("--dir", default=".", help="where to write the key files")
        p.add_argument("--name", default="exstill", help="file name stem")
    else:
        p.add_argument("image", help="card image file")
        if command == "sign":
            p.description = (
                "Sign a packed image with an Ed25519 private key (exstill-pack keygen), after "
                "checking its digest; replaces any earlier signature."
            )
            p.add_argument("--key", required=True, help="Ed25519 private key (PEM)")
            p.add_argument(
                "-o", "--output", help="write the signed image here (default: replace IMAGE)"
            )
        elif command == "verify":
            p.description = "Check an image's structure and digest, and its signature."
            p.add_argument(
                "--trusted-keys",
                help="directory of trusted *.pub keys (or one .pub file): require a signature",
            )
        else:
            p.description = "Show what an image holds, after checking its digest."
            p.add_argument(
                "--no-verify", action="store_true", help="skip the digest check (reads the file)"
            )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _pack(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.image.pack import pack_checkpoint, read_head_ids
    from exstill_sdk.image.signing import load_private_key

    key = load_private_key(args.sign_key) if args.sign_key else None
    head_ids = read_head_ids(args.head_ids) if args.head_ids else None
    result = pack_checkpoint(
        args.checkpoint,
        args.output,
        args.target,
        args.dtype,
        image_version=args.image_version,
        signing_key=key,
        tokenizer=args.tokenizer,
        progress=not args.json and sys.stderr.isatty(),
        head_ids=head_ids,
        rank_temperature=args.rank_temperature,
    )
    return result.to_dict()


def _inspect(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.image.reader import open_image

    with open_image(args.image) as image:
        file_sha256 = None if args.no_verify else image.verify().file_sha256.hex()
        return {
            **image.describe(),
            "file_sha256": file_sha256,
            "digest_checked": file_sha256 is not None,
        }


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.image.reader import open_image
    from exstill_sdk.image.signing import load_trusted_keys

    trusted = load_trusted_keys(args.trusted_keys) if args.trusted_keys else None
    with open_image(args.image) as image:
        v = image.verify(trusted)
        return {
            "path": args.image,
            "ok": True,
            "target": image.target,
            "content_sha256": v.content_sha256.hex(),
            "file_sha256": v.file_sha256.hex(),
            "signed": v.signed,
            "key_id": v.key_id.hex() if v.key_id else None,
            "signature_checked": v.trusted,
        }


def _sign(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.image.signing import load_private_key
    from exstill_sdk.image.writer import sign_image

    written = sign_image(args.image, load_private_key(args.key), args.output)
    return {
        "path": str(written.path),
        "content_sha256": written.content_sha256.hex(),
        "file_sha256": written.file_sha256.hex(),
        "key_id": (written.key_id or b"").hex(),
    }


def _keygen(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.image.signing import generate_keypair, key_id, load_public_key

    key_path, pub_path = generate_keypair(args.dir, args.name)
    return {
        "private_key": str(key_path),
        "public_key": str(pub_path),
        "key_id": key_id(load_public_key(pub_path)).hex(),
    }


def _human(command: str, r: dict[str, Any]) -> str:
    if command == "pack":
        sig = f", signed by {r['key_id'][:16]}" if r["signed"] else ""
        return (
            f"wrote {r['path']}: target {r['target']}, {r['dtype']}, {r['parameters']:,} "
            f"parameters, {r['size']:,} bytes in {r['seconds']} s{sig}\n"
            f"file_sha256 {r['file_sha256']} (what exstill-flash and the card show)"
        )
    if command == "sign":
        return (
            f"signed {r['path']} with key {r['key_id'][:16]}...\n"
            f"file_sha256 {r['file_sha256']} (what exstill-flash and the card show)"
        )
    if command == "verify":
        how = (
            "signature checked against trusted keys"
            if r["signature_checked"]
            else (
                "signed, signature not checked (no --trusted-keys)" if r["signed"] else "unsigned"
            )
        )
        return (
            f"OK {r['path']}: content_sha256 holds, {how}\nfile_sha256 {r['file_sha256']} "
            "(what exstill-flash and the card show)"
        )
    if command == "keygen":
        return (
            f"wrote {r['private_key']} (keep it secret) and {r['public_key']}, "
            f"key id {r['key_id'][:16]}"
        )
    arch = r["arch"]
    tok = r["tokenizer"]
    rows = [
        (
            "architecture",
            f"{arch['name']} from {arch['source'] or '?'}: {arch['num_layers']} layers, hidden "
            f"{arch['hidden_size']}, heads {arch['num_heads']}/{arch['num_kv_heads']} x "
            f"{arch['head_dim']}, vocab {arch['vocab_size']}"
            + (f", output head {arch['head_size']} tokens" if arch.get("head_size") else ""),
        ),
        (
            "weights",
            f"{r['dtype']}, {r['parameters']:,} parameters in {r['tensors']} tensors, "
            f"{r['data_bytes']:,} bytes",
        ),
        (
            "tokenizer",
            f"vocab {tok['vocab_size']}, sha256 {tok['sha256'][:16]}..., special "
            f"{tok['special_ids']}",
        ),
        *_vocab_note(arch["vocab_size"], tok["vocab_size"]),
        (
            "content_sha256",
            r["content_sha256"] + (" (checked)" if r["digest_checked"] else " (not checked)"),
        ),
        (
            "ranking",
            f"tree nodes and outcomes by the draft's softmax at temperature "
            f"{r['rank_temperature']}",
        ),
        ("file_sha256", r["file_sha256"] or "(not computed: --no-verify)"),
        ("signature", f"key {r['key_id'][:16]}..." if r["signed"] else "none"),
        ("created by", r["created_by"]),
    ]
    head = f"{r['path']}: card image for target {r['target']!r} (version {r['image_version']})"
    return "\n".join([head, *(f"  {label:<15} {text}" for label, text in rows)])


def _vocab_note(model_vocab: int, tokenizer_vocab: int) -> list[tuple[str, str]]:
    """Why a tokenizer smaller than the model's vocabulary is fine (models pad their rows)."""
    if tokenizer_vocab >= model_vocab:
        return []
    padding = model_vocab - tokenizer_vocab
    return [
        (
            "",
            f"(the model has {model_vocab} vocabulary rows, {padding} of them padding that no "
            "token uses: expected, the target never produces those ids)",
        )
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else "pack"
    step: Callable[[argparse.Namespace], dict[str, Any]]
    if command == "pack":
        args, step = _pack_parser().parse_args(argv), _pack
    else:
        args = _image_parser(command).parse_args(argv[1:])
        step = {"inspect": _inspect, "verify": _verify, "sign": _sign, "keygen": _keygen}[command]

    def body() -> int:
        result = step(args)
        print_result(result, args.json, lambda: _human(command, result))
        return EXIT_OK

    prog = "exstill-pack" if command == "pack" else f"exstill-pack {command}"
    return run(prog, args.json, body)


if __name__ == "__main__":
    sys.exit(main())
