"""Image classification: uint8 photos in, class probabilities out, judged by agreement with FP32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.datasets import Split, digits_split, photo_split
from pipeline.evaluate import SliceFigures, classification_figures
from pipeline.export import IMAGE_INPUT, IMAGE_OUTPUT, ImageClassifierGraph, ServingGraph
from pipeline.export_check import image_batches
from pipeline.own_data import own_images
from pipeline.recipe import IMAGES_FIELD, ImageClassificationRecipe
from pipeline.sources import load_class_names
from pipeline.students import SmallCNN, distill_classifier, seeded
from pipeline.tasks.base import PipelineTask, TaskData
from pipeline.tuning import HELD_OUT
from pipeline.variants.base import Feeds
from serving.model_runtime import ImageModelRuntime
from serving.model_spec import CLASS_NAMES_FILE, ModelSpec
from serving.monitoring import MonitoringReference, classifier_statistics, reference_of

if TYPE_CHECKING:
    from pipeline.recipe import LoadedRecipe, Student
    from pipeline.sources import SourceModel

PHOTO_PARTS = ("calibration", HELD_OUT, "perturbed")


class ImageClassification(PipelineTask):
    name = "image-classification"
    recipe = ImageClassificationRecipe
    runtime = ImageModelRuntime

    def serving_graph(self, recipe: ImageClassificationRecipe, source: SourceModel) -> ServingGraph:
        size = recipe.image.size
        return ServingGraph(
            module=ImageClassifierGraph(source.module, recipe.image).eval(),
            input_names=[IMAGE_INPUT],
            output_names=[IMAGE_OUTPUT],
            example_inputs=(torch.randint(0, 256, (2, size, size, 3), dtype=torch.uint8),),
            dynamic_axes={IMAGE_INPUT: {0: "batch"}, IMAGE_OUTPUT: {0: "batch"}},
        )

    def prepare(self, loaded: LoadedRecipe, source: SourceModel, graph: ServingGraph, workdir: Path) -> TaskData:
        recipe = loaded.recipe
        spec_in = recipe.image.input_spec()
        class_names = (
            source.class_names
            if source.class_names is not None
            else load_class_names(loaded, getattr(recipe.source, "num_classes", None))
        )
        names = workdir / CLASS_NAMES_FILE
        names.write_text(json.dumps(class_names))
        training = threshold = None
        if recipe.source.kind == "train-digits":
            calibration, held_out, perturbed, training, threshold = (
                digits_split(p) for p in ("calibration", HELD_OUT, "perturbed", "training", "threshold")
            )
            judged_on = f"scikit-learn's digits ({len(held_out)} held out, each also moved)"
        elif (folder := own_images(loaded, class_names)) is not None:
            calibration, held_out, perturbed = (folder.split(spec_in, p) for p in PHOTO_PARTS)
            judged_on = (
                f"the recipe's {IMAGES_FIELD} ({folder.root}): {len(folder.names)} images, "
                f"{len(set(held_out.groups))} judged and {len(set(calibration.groups))} calibrated on, "
                + ("labelled by their class subfolders" if folder.labels else "unlabelled")
            )
        else:
            calibration, held_out, perturbed = (photo_split(spec_in, p) for p in PHOTO_PARTS)
            judged_on = (
                f"the built-in sample photos: {len(set(held_out.groups))} judged and "
                f"{len(set(calibration.groups))} calibrated on, unlabelled"
            )
        return TaskData(
            spec=ModelSpec(
                task=self.name, image=spec_in, input_names=graph.input_names, output_names=graph.output_names
            ),
            files={CLASS_NAMES_FILE: names},
            check_batches=image_batches(spec_in),
            feeds=lambda rows: {graph.input_names[0]: np.stack(rows)},
            calibration=calibration,
            evaluation={HELD_OUT: held_out, "perturbed": perturbed},
            profiling=held_out,  # decoded photos: an image's cost does not depend on what it shows
            training=training,
            threshold=threshold,
            judged_on=f"{judged_on}; {len(held_out)} held-out and {len(perturbed)} perturbed inputs",
        )

    def judge(
        self, reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None, groups: list | None = None
    ) -> SliceFigures:
        return classification_figures(reference, candidate, labels, groups)

    def monitoring_reference(self, name: str, split: Split, outputs: np.ndarray) -> MonitoringReference:
        """Rows without a decoded size (digits, arrays from the start) are as large as the model input."""
        pixels = np.stack(split.rows)
        sizes = split.sizes or [(pixels.shape[2], pixels.shape[1])] * len(pixels)
        return reference_of(name, classifier_statistics(sizes, pixels, outputs))

    def top1_agreement(self, reference: np.ndarray, candidate: np.ndarray) -> float:
        return float((reference.argmax(-1) == candidate.argmax(-1)).mean())

    agreement = top1_agreement

    def distill(self, teacher: torch.nn.Module, training: Split, feeds: Feeds, settings: Student) -> torch.nn.Module:
        """A small CNN from the teacher's softened probabilities plus the labels."""
        if training.labels is None:
            raise ValueError("a classifier student needs labelled training data (e.g. source kind train-digits)")
        images = np.stack(training.rows)
        with torch.inference_mode():
            num_classes = teacher(torch.from_numpy(images[:1])).shape[-1]
        student = teacher.with_model(seeded(lambda: SmallCNN(num_classes, settings.channels)))
        distill_classifier(
            teacher.model,
            student.model,
            teacher.normalize,
            images,
            training.labels,
            epochs=settings.epochs,
            temperature=settings.temperature,
            alpha=settings.alpha,
        )
        return student.eval()
