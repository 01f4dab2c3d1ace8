"""Load and save the Hugging Face layout: `config.json` + one `model.safetensors`, or shards with an index."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.config import ModelConfig
from model.transformer import Transformer

INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A model directory whose weights do not match its config (missing, unexpected or misshapen tensors)."""


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: those its index lists, else every `*.safetensors` in it.
    CheckpointError for an unreadable or malformed index; FileNotFoundError when there are no safetensors (pickled
    `*.bin` / `*.pt` weights are never loaded: they can run code when unpickled)."""
    if (path / INDEX).is_file():
        where = path / INDEX
        try:
            index = json.loads(where.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{where}: not valid JSON ({e}); the index may be truncated") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{where}: expected an object with a non-empty \"weight_map\" "
                                  f"{{tensor name: file name}}")
        bad = [n for n in weight_map.values()
               if not isinstance(n, str) or not n.endswith(".safetensors") or Path(n).name != n]
        if bad:
            raise CheckpointError(f"{where}: weight_map must name *.safetensors files in the same directory, "
                                  f"got {', '.join(repr(n) for n in bad[:3])}")
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        hint = (f" (found {', '.join(pickled[:3])}: pickled weights are not loaded, since unpickling can run code; "
                "convert them to safetensors)") if pickled else ""
        raise FileNotFoundError(f"{path}: no *.safetensors weights next to config.json{hint}")
    return files


def read_state_dict(path: str | Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files. FileNotFoundError for a shard the index lists but that
    is absent; CheckpointError for a truncated or corrupt file, or a tensor stored in two files."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for f in weight_files(Path(path)):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: listed in {INDEX} but missing")
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for key in sf.keys():
                    if key in origin:
                        raise CheckpointError(f"{path}: tensor {key} is stored twice, in {origin[key]} and {f.name}")
                    out[key], origin[key] = sf.get_tensor(key), f.name
        except SafetensorError as e:  # header too small / too large, file not fully covered: truncated or corrupt
            raise CheckpointError(f"{f}: cannot read this safetensors file ({e}); is it truncated or corrupt?"
                                  ) from None
    return out


def read_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers alone (no tensor data is read). The same errors as
    `read_state_dict`: FileNotFoundError for a listed shard that is absent, CheckpointError for a truncated or corrupt
    file (safetensors checks that the header's offsets cover the file exactly) or a tensor stored twice."""
    shapes: dict[str, tuple[int, ...]] = {}
    origin: dict[str, str] = {}
    for f in weight_files(Path(path)):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: listed in {INDEX} but missing")
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    if key in origin:
                        raise CheckpointError(f"{path}: tensor {key} is stored twice, in {origin[key]} and {f.name}")
                    shapes[key], origin[key] = tuple(sf.get_slice(key).get_shape()), f.name
        except SafetensorError as e:
            raise CheckpointError(f"{f}: cannot read this safetensors file ({e}); is it truncated or corrupt?"
                                  ) from None
    return shapes


def check_shapes(path: str | Path, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> int:
    """CheckpointError unless the tensors (name -> shape) are exactly those config.json implies (a tied lm_head may
    be stored or not); the number of tensors checked. Builds the model on the meta device: no memory."""
    with torch.device("meta"):
        model = Transformer(cfg)
    tied = cfg.tie_word_embeddings
    shapes = {k: v for k, v in shapes.items() if not (tied and k == "lm_head.weight")}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match config.json: missing {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''}")
    wrong = [f"{k} has shape {shapes[k]}, config.json implies {v}"
             for k, v in expected.items() if shapes[k] != v]  # in module order
    if wrong:
        raise CheckpointError(f"{path}: {len(wrong)} tensor(s) do not match config.json: {'; '.join(wrong[:4])}"
                              f"{' ...' if len(wrong) > 4 else ''}")
    return len(expected)


def load_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Transformer:
    """Build our Transformer from a local HF directory. dtype defaults to the checkpoint's."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    cfg = ModelConfig.from_dir(path)
    dtype = dtype or cfg.torch_dtype
    with torch.device("meta"):
        model = Transformer(cfg)
    state = read_state_dict(path, device)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    check_shapes(path, cfg, {k: tuple(v.shape) for k, v in state.items()})
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device)


def save_model(model: Transformer | dict[str, torch.Tensor], cfg: ModelConfig, path: str | Path,
               max_shard_bytes: int = 5 << 30, dtype: torch.dtype | None = None) -> None:
    """Write config.json and safetensors (sharded with an index above max_shard_bytes). Accepts a model or a
    full (gathered) state dict. Written to a temporary directory first, then renamed into place."""
    path = Path(path)
    state = model.state_dict() if isinstance(model, torch.nn.Module) else dict(model)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in state:  # keep module order; start a new shard when this one is full
        nbytes = state[k].numel() * state[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = state[k]
        size += nbytes
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf()
    if dtype is not None:
        hf["dtype"] = str(dtype).replace("torch.", "")
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if path.exists():  # keep any other files (tokenizer) already there; replace our own
        for f in list(path.glob("*.safetensors")) + [path / INDEX, path / "config.json"]:
            if f.exists():
                f.unlink()
        for f in tmp.iterdir():
            os.replace(f, path / f.name)
        tmp.rmdir()
    else:
        os.replace(tmp, path)
