"""exstill-pack: make, inspect, verify and sign card images.

exstill-pack CHECKPOINT_DIR -o IMAGE --target NAME [--dtype f32|f16|int8] [--sign-key KEY]
exstill-pack inspect IMAGE [--json]
exstill-pack verify IMAGE [--trusted-keys DIR|FILE] [--json]
exstill-pack keygen [--dir DIR] [--name NAME] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from exstill_sdk.errors import ExstillError, ImageError

SUBCOMMANDS = ("inspect", "verify", "keygen")


def _pack_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="exstill-pack",
        description="Pack an HF checkpoint (Llama, Mistral, Qwen2, Qwen3; safetensors) into a "
        "card image. Other commands: exstill-pack {inspect,verify,keygen} --help",
    )
    p.add_argument(
        "checkpoint", help="HF checkpoint directory (config.json, safetensors, tokenizer.json)"
    )
    p.add_argument("-o", "--output", required=True, help="image file to write")
    p.add_argument("--target", required=True, help="the target name streams will open")
    p.add_argument("--dtype", choices=["f32", "f16", "int8"], default="f32", help="matrix dtype")
    p.add_argument("--sign-key", help="Ed25519 private key (PEM) to sign the image with")
    p.add_argument("--tokenizer", help="the target's tokenizer.json, if the checkpoint has none")
    p.add_argument("--image-version", default="1", help="version string stored in the image")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def _image_parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"exstill-pack {command}")
    if command == "keygen":
        p.description = "Make an Ed25519 key pair for signing images: NAME.key and NAME.pub."
        p.add_argument("--dir", default=".", help="where to write the key files")
        p.add_argument("--name", default="exstill", help="file name stem")
    else:
        p.add_argument("image", help="card image file")
        if command == "verify":
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
    from exstill_sdk.image.pack import pack_checkpoint
    from exstill_sdk.image.signing import load_private_key

    key = load_private_key(args.sign_key) if args.sign_key else None
    result = pack_checkpoint(
        args.checkpoint,
        args.output,
        args.target,
        args.dtype,
        image_version=args.image_version,
        signing_key=key,
        tokenizer=args.tokenizer,
        progress=not args.json and sys.stderr.isatty(),
    )
    return result.to_dict()


def _inspect(args: argparse.Namespace) -> dict[str, Any]:
    from exstill_sdk.image.reader import open_image

    with open_image(args.image, verify=not args.no_verify) as image:
        return {**image.describe(), "digest_checked": not args.no_verify}


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
            "digest": v.digest.hex(),
            "signed": v.signed,
            "key_id": v.key_id.hex() if v.key_id else None,
            "signature_checked": v.trusted,
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
            f"parameters, {r['size']:,} bytes in {r['seconds']} s{sig}\ndigest {r['digest']}"
        )
    if command == "verify":
        how = (
            "signature checked against trusted keys"
            if r["signature_checked"]
            else (
                "signed, signature not checked (no --trusted-keys)" if r["signed"] else "unsigned"
            )
        )
        return f"OK {r['path']}: digest {r['digest'][:16]}..., {how}"
    if command == "keygen":
        return (
            f"wrote {r['private_key']} (keep it secret) and {r['public_key']}, "
            f"key id {r['key_id'][:16]}"
        )
    arch = r["arch"]
    return "\n".join(
        [
            f"{r['path']}: card image for target {r['target']!r} (version {r['image_version']})",
            f"  architecture  {arch['name']} from {arch['source'] or '?'}: {arch['num_layers']} "
            f"layers, hidden {arch['hidden_size']}, heads {arch['num_heads']}/"
            f"{arch['num_kv_heads']} x {arch['head_dim']}, vocab {arch['vocab_size']}",
            f"  weights       {r['dtype']}, {r['parameters']:,} parameters in {r['tensors']} "
            f"tensors, {r['data_bytes']:,} bytes",
            f"  tokenizer     vocab {r['tokenizer']['vocab_size']}, sha256 "
            f"{r['tokenizer']['sha256'][:16]}..., special {r['tokenizer']['special_ids']}",
            f"  digest        {r['digest']}"
            + (" (checked)" if r["digest_checked"] else " (not checked)"),
            f"  signature     {('key ' + r['key_id'][:16] + '...') if r['signed'] else 'none'}",
            f"  created by    {r['created_by']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else "pack"
    run: Callable[[argparse.Namespace], dict[str, Any]]
    if command == "pack":
        args, run = _pack_parser().parse_args(argv), _pack
    else:
        args = _image_parser(command).parse_args(argv[1:])
        run = {"inspect": _inspect, "verify": _verify, "keygen": _keygen}[command]
    try:
        result = run(args)
    except (ExstillError, OSError) as exc:
        message = exc.message if isinstance(exc, ExstillError) else str(exc)
        if args.json:
            print(json.dumps({"ok": False, "error": message, "code": int(getattr(exc, "code", 0))}))
        else:
            print(f"exstill-pack {command}: {message}", file=sys.stderr)
        return 1 if isinstance(exc, ImageError) else 2
    print(json.dumps(result) if args.json else _human(command, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
