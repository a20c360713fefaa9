"""Where a quantized disk file parts from the forward it is checked against: per layer,
the share of its keys and values more than half a grid step off and the largest step,
against the forward over the path's kept KV (the check's own) and against a plain one;
then the share by token position (a foreign span is contiguous and large everywhere).

    python bench/experiments/soak-on-cuda/quantized_files.py DISK_DIR [FILE_STEM ...]

DISK_DIR is a soak's --disk-cache-dir (its one model folder is read); the stems are the
files the soak named wrong (all files if none). Run it where the soak ran: on a GPU the
noise it measures is the GPU's.
"""

import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm

import tests.engine.kv_integrity as integrity
from engine import segment_file
from engine.model_source import resolve_model


def flips(stored: mx.array, want: mx.array, step: mx.array) -> mx.array:
    return mx.abs(stored.astype(mx.float32) - want.astype(mx.float32)) / step


def main(disk: Path, stems: list[str]) -> None:
    integrity.apply_mlx_env_defaults()
    folder = next(p for p in disk.iterdir() if p.is_dir())
    model = mlx_lm.load(str(resolve_model(None)))[0]
    headers = {}
    for path in folder.glob(f"*{segment_file.SUFFIX}"):
        header, _, _ = segment_file.read_header(path)
        headers[header.key] = (path, header)
    read = integrity._file_reader(model)
    for path, header in headers.values():
        if stems and path.stem not in stems:
            continue
        chain, parent = [(path, header)], header.parent
        while parent in headers:
            chain.append(headers[parent])
            parent = chain[-1][1].parent
        chain.reverse()
        tokens = tuple(t for _, part in chain for t in part.tokens)
        handle = read(path, header)
        kept = integrity._fresh(model, tokens, {},
                                (handle.quantization, [read(*link) for link in chain]))
        plain = integrity._fresh(model, tokens, {})
        start, end = header.start, len(tokens)
        print(f"{path.name}: tokens {start}-{end}, {len(chain)} files in its chain")
        by_position = []
        for layer in range(len(kept)):
            row = []
            for side, stored_layers in ((0, handle.keys), (1, handle.values)):
                stored = stored_layers[layer]
                step = integrity._step(handle, side, layer, stored)
                over_kept = flips(stored, kept[layer][side][..., start:end, :], step)
                over_plain = flips(stored, plain[layer][side][..., start:end, :], step)
                by_position.append((over_kept > 0.5).astype(mx.float32).mean(axis=(0, 1, 3)))
                row.append(f"{'kv'[side]} {float((over_kept > 0.5).mean()):.3f} "
                           f"(max {float(over_kept.max()):.1f}; plain "
                           f"{float((over_plain > 0.5).mean()):.3f}, "
                           f"max {float(over_plain.max()):.1f})")
            print(f"  layer {layer:2d}: " + "  ".join(row))
        shares = mx.stack(by_position).mean(axis=0).tolist()
        print("  by position: " + " ".join(f"{start + i}:{v:.2f}" for i, v in enumerate(shares)))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
