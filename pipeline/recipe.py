"""Recipes (`models/<name>.yaml`): validated so that a mistake is one line naming the field."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Annotated, ClassVar, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from serving.aliases import ALIAS_NAME, DEFAULT_ALIAS
from serving.artifacts import file_digest
from serving.manifest import Share, check_sides
from serving.model_spec import ImageInput, Task

PACKAGE_PREFIX = "package:"
REQUESTS_FIELD = "profiling.requests"
IMAGES_FIELD = "data.images"
TEXTS_FIELD = "data.texts"


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file and the field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EfficientNetLiteSource(Strict):
    """EfficientNet-Lite from `efficientnet-lite-pytorch` with a local or packaged weights file."""

    kind: Literal["efficientnet-lite"]
    architecture: Literal[
        "efficientnet-lite0", "efficientnet-lite1", "efficientnet-lite2", "efficientnet-lite3", "efficientnet-lite4"
    ]
    weights: str = Field(description="state_dict file: a path relative to the recipe, or package:<module>/<file>")
    num_classes: int = 1000


# Builders that, given ImageNet weights, turn on `transform_input` (re-normalizing ImageNet-normalized
# pixels to (x - 0.5) / 0.5 inside the model): a network fine-tuned from those weights keeps it, one
# trained from scratch does not, and the state_dict does not say which.
TRANSFORMS_INPUT = frozenset({"inception_v3", "googlenet"})


class TorchvisionSource(Strict):
    """Any torchvision classification architecture with your own state_dict."""

    kind: Literal["torchvision"]
    architecture: str = Field(description="a torchvision.models builder name, e.g. resnet18")
    weights: str
    num_classes: int = Field(default=1000, ge=1, description="at least 2: answers are a softmax")
    options: dict[str, bool | int | float | str] = Field(
        default_factory=dict,
        description="the builder's keyword arguments as training used them, e.g. {transform_input: true}",
    )

    def options_fault(self) -> str | None:
        """Why `options` cannot build the network the weights were trained in, or None."""
        for field in ("weights", "num_classes"):
            if field in self.options:
                return f"source.options.{field}: give source.{field} instead"
        if self.architecture in TRANSFORMS_INPUT and "transform_input" not in self.options:
            return (
                f"source.options.transform_input: {self.architecture} fine-tuned from torchvision's ImageNet "
                "weights has it true (the builder sets it), trained from scratch false, and the weights do not "
                "say which: state it, as the wrong one answers wrongly"
            )
        return None


class TrainDigitsSource(Strict):
    """The pipeline trains its own teacher (a small ResNet) on scikit-learn's digits."""

    kind: Literal["train-digits"]
    epochs: int = Field(default=40, ge=1)
    channels: int = Field(default=64, ge=4)
    blocks: int = Field(default=3, ge=1)


class HuggingFaceSource(Strict):
    """A local Hugging Face model directory (never fetched from a hub)."""

    kind: Literal["huggingface"]
    path: str = Field(description="model directory: a path relative to the recipe, or package:<module>/<dir>")


# Tags of the discriminated unions: pydantic puts them in error locations, users never wrote them.
UNION_TAGS = frozenset({"efficientnet-lite", "torchvision", "huggingface", "train-digits", *get_args(Task)})


class ImagePreprocess(Strict):
    size: int = Field(gt=0, description="square input side the model sees")
    resize: int = Field(gt=0, description="shorter side before the centre crop")
    mean: tuple[float, float, float] = Field(description="per-channel mean on the 0-255 scale")
    std: tuple[float, float, float] = Field(description="per-channel std on the 0-255 scale")
    crop: bool = Field(
        default=True, description="false: the whole photo squeezed to size x size, no centre crop (ViT's processor)"
    )

    @model_validator(mode="after")
    def _crop_fits(self) -> ImagePreprocess:
        if self.resize < self.size:
            raise ValueError(f"resize ({self.resize}) must be at least size ({self.size})")
        if not self.crop and self.resize != self.size:
            raise ValueError(f"resize ({self.resize}): without a crop the photo is resized to size ({self.size})")
        return self

    @model_validator(mode="after")
    def _on_the_0_255_scale(self) -> ImagePreprocess:
        """torchvision's [0.485, 0.456, 0.406] / [0.229, 0.224, 0.225] are on the 0-1 scale; copied here
        they would export, pass every check (PyTorch sees the same inputs) and serve wrong answers."""
        if min(self.std) <= 0:
            raise ValueError(f"std: {list(self.std)}: every channel's must be above 0")
        if max(self.std) < 1 or (min(self.mean) > 0 and max(self.mean) <= 1):
            mean, std = ([round(value * 255, 3) for value in values] for values in (self.mean, self.std))
            raise ValueError(
                f"mean {list(self.mean)}, std {list(self.std)} look like the 0-1 scale; pixels here are 0-255 "
                f"(× 255: mean {mean}, std {std})"
            )
        return self

    def input_spec(self) -> ImageInput:
        """What the service does to a photo before the graph (which normalizes)."""
        return ImageInput(size=self.size, resize=self.resize, crop=self.crop)


class TextPreprocess(Strict):
    max_length: int = Field(gt=2, le=8192, description="tokens per text, special tokens included")


class ExportTolerance(Strict):
    max_abs_diff: float = Field(gt=0)
    min_cosine: float = Field(gt=0, le=1)
    min_top1_agreement: float = Field(default=1.0, ge=0, le=1, description="classification only")


class Export(Strict):
    opset: int = Field(default=17, ge=13)
    tolerance: ExportTolerance


class Serving(Strict):
    endpoint: Literal["classify", "embed"] | None = Field(
        default=None,
        description="also the default endpoint's model; every model is served at /models/<name>/",
    )
    max_batch_size: int | None = Field(
        default=None, ge=2, le=1024, description="override the profiled value (BentoML batches at least 2)"
    )
    max_batch_tokens: int | None = Field(
        default=None, ge=1, description="text: override the profiled cap on padded tokens per engine call"
    )
    max_latency_ms: int | None = Field(
        default=None, ge=1, description="override; BentoML sheds requests it cannot serve within this"
    )
    max_items_per_request: int = Field(default=64, ge=1)
    cache_mb: float | None = Field(
        default=None, gt=0, description="a response cache of this many MB per front worker; off when absent"
    )
    alias: str = Field(
        default=DEFAULT_ALIAS,
        pattern=ALIAS_NAME,
        description="the alias the endpoint serves once it is set (`python -m pipeline promote`)",
    )
    canary: Share | None = Field(default=None, description="another alias answering a share of the requests")
    shadow: Share | None = Field(default=None, description="another alias running a share of the requests beside")
    variant: str | None = Field(
        default=None, description="serve this variant where the gate accepts it, instead of the fastest accepted"
    )

    @model_validator(mode="after")
    def _sides_are_other_aliases(self) -> Serving:
        check_sides(self.alias, self.canary, self.shadow)
        return self


VariantName = Literal[
    "graph-opt",
    "int8-dynamic",
    "int8-static",
    "fp16",
    "student",
    "student-int8",
    "inc-int8",
    "openvino",
    "openvino-int8",
    "openvino-bf16",
    "cascade",  # pipeline/cascade.py: a student, with the teacher for what it is unsure of; classifiers only
]

# Image variants that train a student: they need labelled training images (and the cascade a split
# of its own to set its threshold on), which only the train-digits source brings.
LABELLED_TRAINING = frozenset({"student", "student-int8", "cascade"})


class Budget(Strict):
    max_drop: dict[str, float] = Field(description="metric → largest drop from the FP32 model's own score")
    p99_slo_ms: float = Field(
        default=1000, ge=1, allow_inf_nan=False, description="p99 of one model call at the chosen batch size"
    )

    @model_validator(mode="after")
    def _drops_are_fractions(self) -> Budget:
        for metric, drop in self.max_drop.items():
            if not 0 <= drop <= 1:
                raise ValueError(f"max_drop.{metric} must be between 0 and 1, got {drop}")
        if not self.max_drop:
            raise ValueError("max_drop needs at least one metric")
        return self


class Student(Strict):
    """Distillation settings for the `student` variant."""

    epochs: int = Field(default=30, ge=1)
    temperature: float = Field(default=4.0, gt=0, description="classifiers: softening of teacher targets")
    alpha: float = Field(default=0.7, ge=0, le=1, description="classifiers: weight of the teacher term")
    channels: int = Field(default=16, ge=2, description="classifiers: width of the student CNN")
    layers: int = Field(default=3, ge=1, description="text: teacher layers the student keeps, evenly spread")


class Profiling(Strict):
    max_batch_size: int = Field(default=64, ge=1, le=1024)
    seconds_per_point: float = Field(default=2.0, gt=0)
    requests: str | None = Field(
        default=None,
        description="text: a file of real requests, one text per line; default a profiling part of the sample corpus",
    )


class ImageData(Strict):
    """The user's own images, calibrated and judged on instead of the sample photos."""

    images: str = Field(
        description="a folder of images (jpg, png, webp, bmp), searched recursively; subfolders named "
        "after the labels (ImageFolder layout) label them"
    )


class TextData(Strict):
    """The user's own texts, calibrated, judged, profiled and distilled on instead of the sample corpus."""

    texts: str = Field(description="a UTF-8 text file, one text per line")


class RecipeBase(Strict):
    """What every task's recipe says; each task's recipe adds its own inputs and source kinds."""

    metrics: ClassVar[tuple[str, ...]]  # what `budget.max_drop` may bound for this task
    endpoint: ClassVar[str]  # the default endpoint that answers this task's models
    name: str = Field(
        pattern=r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$",
        max_length=63,  # BentoML's longest tag name
        description="model store name: lowercase letters, digits, '.', '_', '-'",
    )
    description: str = ""
    export: Export
    variants: list[VariantName] = Field(default_factory=list, description="tried in this order, after FP32")
    budget: Budget | None = None
    student: Student = Student()
    profiling: Profiling = Profiling()
    serving: Serving = Serving()  # absent: served at /models/<name>/ only, as profiled

    @model_validator(mode="after")
    def _budget_fits(self) -> RecipeBase:
        if self.variants and self.budget is None:
            raise ValueError("variants need a budget: every variant is judged against it")
        if "cascade" in self.variants and self.task != "image-classification":
            raise ValueError(f"variants: a cascade answers with a classifier's confidence, not a {self.task} model's")
        if self.serving.variant not in (None, "fp32", *self.variants):
            raise ValueError(f"serving.variant: {self.serving.variant!r} is not among the recipe's variants")
        if self.serving.endpoint not in (None, self.endpoint):
            raise ValueError(
                f"serving.endpoint: {self.serving.endpoint!r} does not answer {self.task} models; "
                f"{self.endpoint!r} does"
            )
        for metric in self.budget.max_drop if self.budget else ():
            if metric not in self.metrics:
                raise ValueError(
                    f"budget.max_drop.{metric}: not a metric of {self.task} (known: {', '.join(self.metrics)})"
                )
        return self

    @property
    def slo_ms(self) -> float:
        """The p99 one model call must meet at the batch size chosen: the budget's, else 1 s."""
        return self.budget.p99_slo_ms if self.budget else Budget.model_fields["p99_slo_ms"].default

    def file_fields(self) -> dict[str, str]:
        """Recipe field → the file reference it holds, for the loader to resolve and hash."""
        fields = {}
        if isinstance(self.source, HuggingFaceSource):
            fields["source.path"] = self.source.path
        elif not isinstance(self.source, TrainDigitsSource):
            fields["source.weights"] = self.source.weights
        if self.profiling.requests:
            fields[REQUESTS_FIELD] = self.profiling.requests
        return fields


class ImageClassificationRecipe(RecipeBase):
    metrics = ("top1_agreement", "top5_agreement", "top5_overlap", "kl_divergence", "accuracy")
    endpoint = "classify"
    task: Literal["image-classification"]
    source: Annotated[
        EfficientNetLiteSource | TorchvisionSource | TrainDigitsSource | HuggingFaceSource, Field(discriminator="kind")
    ]
    labels: str | None = Field(
        default=None,
        description="'imagenet', or a text file with one label per line; train-digits: omit; huggingface: "
        "config.json's id2label when omitted",
    )
    image: ImagePreprocess | None = Field(
        default=None, description="huggingface: preprocessor_config.json's when omitted (load_recipe fills it)"
    )
    data: ImageData | None = None

    @model_validator(mode="after")
    def _images_need(self) -> ImageClassificationRecipe:
        if self.labels is None and self.source.kind not in ("train-digits", "huggingface"):
            raise ValueError(f"task {self.task} needs the field 'labels'")
        if self.image is None and self.source.kind != "huggingface":
            raise ValueError(f"task {self.task} needs the field 'image' (only a huggingface source has its own)")
        if isinstance(self.source, TorchvisionSource) and (fault := self.source.options_fault()):
            raise ValueError(fault)
        if getattr(self.source, "num_classes", 2) < 2:
            raise ValueError(
                "source.num_classes: 1 output is a sigmoid classifier, which the softmax this serves makes "
                "always 1.0; give it two outputs (and two labels)"
            )
        needs_training = [variant for variant in self.variants if variant in LABELLED_TRAINING]
        if needs_training and self.source.kind != "train-digits":
            # Found at load, not as a "rejected" trial after the export and the FP32 evaluation.
            raise ValueError(
                f"variants: {', '.join(needs_training)}: a classifier's student learns from labelled training "
                f"images, which only a train-digits source has (a {self.source.kind} source is judged on "
                "unlabelled photos); leave them out"
            )
        if self.data is not None and self.source.kind == "train-digits":
            raise ValueError(
                "data: a train-digits source trains its teacher and is judged on scikit-learn's digits; leave data out"
            )
        if (
            self.budget
            and "accuracy" in self.budget.max_drop
            and self.source.kind != "train-digits"
            and self.data is None
        ):
            raise ValueError(
                f"budget.max_drop.accuracy: the evaluation photos of a {self.source.kind} source have no labels "
                f"to count it on (bound top1_agreement instead, or give {IMAGES_FIELD}: a folder of class "
                "subfolders named after the labels)"
            )
        for field, value in (
            (REQUESTS_FIELD, self.profiling.requests),
            ("serving.max_batch_tokens", self.serving.max_batch_tokens),
        ):
            if value is not None:
                raise ValueError(f"{field}: text tasks only (images are batched by rows)")
        return self

    def file_fields(self) -> dict[str, str]:
        labels = {"labels": self.labels} if self.labels and self.labels != "imagenet" else {}
        data = {IMAGES_FIELD: self.data.images} if self.data else {}
        return super().file_fields() | labels | data


class TextEmbeddingRecipe(RecipeBase):
    metrics = ("mean_cosine", "min_cosine", "knn10_agreement")
    endpoint = "embed"
    task: Literal["text-embedding"]
    source: Annotated[HuggingFaceSource, Field(discriminator="kind")]
    text: TextPreprocess
    data: TextData | None = None

    def file_fields(self) -> dict[str, str]:
        return super().file_fields() | ({TEXTS_FIELD: self.data.texts} if self.data else {})


# One recipe class per task (`pipeline/tasks/` registers the behaviour under the same name).
Recipe = Annotated[ImageClassificationRecipe | TextEmbeddingRecipe, Field(discriminator="task")]
RECIPE_ADAPTER: TypeAdapter[Recipe] = TypeAdapter(Recipe)


FOLDER_FIELDS = frozenset({"source.path", IMAGES_FIELD})  # a Hugging Face model's folder, the user's images


def resolve_path(reference: str, recipe_dir: Path) -> Path:
    """A path relative to the recipe, or `package:<module>/<sub/path>` inside an installed package."""
    if reference.startswith(PACKAGE_PREFIX):
        module, _, inner = reference[len(PACKAGE_PREFIX) :].partition("/")
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # a dotted name whose parent package is missing, or malformed
            spec = None
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"package {module!r} is not installed (pip install it or `make setup`)")
        return Path(spec.origin).parent / inner
    path = Path(reference).expanduser()
    return path if path.is_absolute() else recipe_dir / path


class LoadedRecipe(BaseModel):
    """A validated recipe with its file references resolved and checked."""

    model_config = ConfigDict(frozen=True)
    recipe: Recipe
    path: Path
    files: dict[str, Path]
    derived: tuple[str, ...] = ()  # recipe fields the loader filled from the source (a HF classifier's `image`)

    @property
    def name(self) -> str:
        return self.recipe.name

    def content_hash(self, extra: str = "") -> str:
        """Changes when what a build makes would change: the recipe, or any file it points at.
        Its `serving` section is left out: it goes to the manifest's route, never into a stored
        model, so turning a cache on or moving an alias needs no rebuild; but for `serving.variant`,
        which the build selects, profiles in full and measures the memory of (unset, it adds
        nothing, so that the builds of recipes without it are found again); `data` likewise counts
        only where given (its files do, through `files`; of a folder of images, the images the build
        reads, so that a `.DS_Store` or a notes file beside them rebuilds nothing)."""
        from pipeline.datasets import image_files  # numpy, Pillow and the serving path: 0.8 s, only here

        unset = {"data"} if self.recipe.data is None else set()
        digest = hashlib.sha256(self.recipe.model_dump_json(exclude={"serving", *unset}).encode())
        if self.recipe.serving.variant is not None:
            digest.update(f"serving.variant={self.recipe.serving.variant}".encode())
        for field, path in sorted(self.files.items()):
            digest.update(field.encode())
            digest.update(file_digest(path, image_files(path) if field == IMAGES_FIELD else None).encode())
        digest.update(extra.encode())
        return digest.hexdigest()[:16]


def request_texts(path: Path) -> list[str]:
    """The texts of a requests file, one per line; blank lines are no requests."""
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _format_error(path: Path, exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        location = ".".join(str(p) for p in error["loc"] if p not in UNION_TAGS)
        message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {location}: {message}" if location else f"{path}: {message}")
    return "\n".join(lines)


def field_texts(loaded: LoadedRecipe, field: str) -> list[str]:
    """The texts of a recipe's text file (`field`), one per line; unreadable is refused naming it."""
    path = loaded.files[field]
    try:
        return request_texts(path)
    except (OSError, UnicodeDecodeError):
        raise RecipeError(f"{loaded.path}: {field}: not a readable UTF-8 text file: {path}") from None


def _check_requests(loaded: LoadedRecipe) -> None:
    """Profiling needs at least one text: an empty file would fail only after the export."""
    if not field_texts(loaded, REQUESTS_FIELD):
        raise RecipeError(
            f"{loaded.path}: {REQUESTS_FIELD}: no texts in {loaded.files[REQUESTS_FIELD]} (one request per line)"
        )


class RepeatedKey(yaml.YAMLError):
    def __init__(self, key: object, line: int) -> None:
        super().__init__(f"line {line}: {key!r} is given twice in one mapping")


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error: PyYAML keeps the last
    silently, and a second `serving:` block would drop the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise RepeatedKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_recipe(path: Path) -> LoadedRecipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except RepeatedKey as exc:
        raise RecipeError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping of fields")
    try:
        # Strictly, as JSON: a number must be a number (YAML's `yes` is no 1 MB cache, nor "16" 16
        # items), while lists still fill the tuple fields.
        recipe = RECIPE_ADAPTER.validate_json(json.dumps(raw, default=str), strict=True)
    except ValidationError as exc:
        raise RecipeError(_format_error(path, exc)) from None
    files = {}
    for field, reference in recipe.file_fields().items():
        try:
            resolved = resolve_path(reference, path.parent)
        except FileNotFoundError as exc:
            raise RecipeError(f"{path}: {field}: {exc}") from None
        if not resolved.exists():
            raise RecipeError(f"{path}: {field}: file not found: {resolved}")
        if resolved.is_dir() != (field in FOLDER_FIELDS):
            wanted = "a folder" if field in FOLDER_FIELDS else "a file"
            raise RecipeError(f"{path}: {field}: {resolved} is not {wanted}")
        files[field] = resolved
    loaded = LoadedRecipe(recipe=recipe, path=path, files=files)
    if REQUESTS_FIELD in files:
        _check_requests(loaded)
    if isinstance(recipe, ImageClassificationRecipe) and recipe.image is None:
        recipe = recipe.model_copy(update={"image": _processor_preprocess(path, files["source.path"])})
        loaded = LoadedRecipe(recipe=recipe, path=path, files=files, derived=("image",))
    return loaded


def _processor_preprocess(path: Path, model_dir: Path) -> ImagePreprocess:
    """A Hugging Face classifier's `image:` from its own processor, so that every consumer of the
    recipe (the build, the benchmarks) sees the pre-processing the service will do."""
    from pipeline.image_processor import ImageProcessorError, preprocess_of

    try:
        return ImagePreprocess(**preprocess_of(model_dir)._asdict())
    except ImageProcessorError as exc:
        raise RecipeError(f"{path}: image: {exc}") from None
