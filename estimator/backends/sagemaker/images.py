"""The container image of a SageMaker job: SageMaker's PyTorch training images whose torch smsdp supports.

smsdp names these images itself, whatever SageMaker SDK is installed: SDK 2.257's table
ends at torch 2.8 and SDK 3.27's at 2.10, and from torch 2.11 on AWS publishes its PyTorch
training images (Deep Learning Containers, "DLC") under a new repository name, ``pytorch``,
with tags such as ``2.13.0-cu133-amzn2023-sagemaker``. Sources (the repository as of
2026-08-21): https://github.com/aws/deep-learning-containers, files
``docs/src/data/pytorch/<version>-{cuda,cpu}-sagemaker.yml`` (tags, Python, CUDA; release
dates 2026-04-30, 2026-07-02, 2026-07-20 for 2.11, 2.12, 2.13),
``.github/config/image/pytorch/<version>-sagemaker-cuda.yml`` (the torch each image holds) and
``docs/reference/region_availability.md`` (the registry account of each region).

A job gets, in order: ``image_uri`` when given (a DLC or SMP image is checked by the torch
version its tag names; any other image is accepted and recorded as unchecked); the image of
``framework_version`` from the table below; for a supported version the table does not list,
the installed SDK's own table (``sdk.sdk_training_image_uri``). A ``framework_version`` or a
recognized image older than ``MIN_TORCH`` is refused when the Estimator is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from estimator.validation import problem
from smsdp.config.torch_support import SUPPORTED_RANGE, is_supported, release

REPOSITORY = "pytorch"  # torch 2.11 and newer; "pytorch-training" before


@dataclass(frozen=True)
class PyTorchImage:
    """One SageMaker PyTorch training image (the GPU and the CPU variant of one torch release)."""

    framework_version: str
    py_version: str
    cuda: str
    gpu_tag: str
    cpu_tag: str


#: Newest first: the first row is the default image.
IMAGES = (
    PyTorchImage("2.13.0", "py312", "cu133", "2.13.0-cu133-amzn2023-sagemaker", "2.13.0-cpu-amzn2023-sagemaker"),
    PyTorchImage("2.12.1", "py312", "cu130", "2.12.1-cu130-amzn2023-sagemaker", "2.12.1-cpu-amzn2023-sagemaker"),
    PyTorchImage("2.11.0", "py312", "cu130", "2.11.0-cu130-amzn2023-sagemaker", "2.11.0-cpu-amzn2023-sagemaker"),
)
DEFAULT = IMAGES[0]

#: The account of the DLC registry in each region (docs/reference/region_availability.md).
DLC_ACCOUNTS = {
    **dict.fromkeys(
        (
            "us-east-1",
            "us-east-2",
            "us-west-1",
            "us-west-2",
            "ap-south-1",
            "ap-northeast-1",
            "ap-northeast-2",
            "ap-southeast-1",
            "ap-southeast-2",
            "ca-central-1",
            "eu-central-1",
            "eu-west-1",
            "eu-west-2",
            "eu-west-3",
            "eu-north-1",
            "sa-east-1",
        ),
        "763104351884",
    ),
    "af-south-1": "626614931356",
    "ap-east-1": "871362719292",
    "ap-east-2": "975050140332",
    "ap-south-2": "772153158452",
    "ap-southeast-3": "907027046896",
    "ap-southeast-4": "457447274322",
    "ap-southeast-5": "550225433462",
    "ap-southeast-6": "633930458069",
    "ap-southeast-7": "590183813437",
    "ap-northeast-3": "364406365360",
    "ca-west-1": "204538143572",
    "eu-south-1": "692866216735",
    "eu-south-2": "503227376785",
    "eu-central-2": "380420809688",
    "il-central-1": "780543022126",
    "mx-central-1": "637423239942",
    "me-south-1": "217643126080",
    "me-central-1": "914824155844",
    "cn-north-1": "727897471807",
    "cn-northwest-1": "727897471807",
}

#: Repositories whose tags start with the torch version: the DLC PyTorch and Hugging Face
#: training images and the SMP v2 image (frozen at torch 2.5.1).
_TORCH_TAGGED = {"pytorch", "pytorch-training", "huggingface-pytorch-training", "smdistributed-modelparallel"}
_IMAGE = re.compile(r"^(?P<registry>[^/]+)/(?:deep-learning-containers/)?(?P<repository>[^:@]+)(?::(?P<tag>[^@]+))?")
_HOW_TO_PASS = (
    "pass framework_version='{default}' (or leave it out: the default image has torch {default}), or "
    "image_uri= of an image with torch {supported} (a custom image is accepted unchecked)"
)


class ImageSource(str, Enum):
    SMSDP = "smsdp's image table"
    SDK = "the SageMaker SDK's image table"
    GIVEN = "image_uri"


@dataclass(frozen=True)
class ImageChoice:
    """What the Estimator asked for: ``image_uri``, or a framework version (and Python version)."""

    framework_version: str | None
    py_version: str | None
    image_uri: str | None = None

    @property
    def torch(self) -> str | None:
        """The torch version of the image, when it is known (None: a custom image, unchecked)."""
        if self.image_uri is not None:
            return torch_of_image(self.image_uri)
        return self.framework_version

    def describe(self, uri: str, source: ImageSource) -> dict[str, object]:
        """What the dry run records about the image."""
        torch = self.torch
        return {
            "uri": uri,
            "from": source.value,
            "torch": torch
            if torch is not None
            else "unchecked (a custom image: smsdp needs torch " + SUPPORTED_RANGE + ")",
        }


DEFAULT_CHOICE = ImageChoice(DEFAULT.framework_version, DEFAULT.py_version)


def choose_image(image_uri: object, framework_version: object, py_version: object) -> ImageChoice:
    """The Estimator's image arguments, checked; raises ``ConfigError`` naming the field."""
    if image_uri is not None:
        if not isinstance(image_uri, str) or not image_uri:
            raise problem(
                "image_uri",
                "must be a container image URI such as '<account>.dkr.ecr.<region>.amazonaws.com/<repo>:<tag>'",
                image_uri,
            )
        torch = torch_of_image(image_uri)
        if torch is not None and not is_supported(torch):
            raise problem("image_uri", _too_old(f"is an image with torch {torch}"), image_uri)
        return ImageChoice(None if framework_version is None else str(framework_version), _text(py_version), image_uri)
    if framework_version is None and py_version is None:
        return DEFAULT_CHOICE
    if framework_version is None:
        raise problem(
            "framework_version",
            f"is missing: give it with py_version (e.g. '{DEFAULT.framework_version}'), or neither "
            "for the default PyTorch image, or image_uri=",
        )
    version = _full_version(str(framework_version))
    if release(version) is None or not is_supported(version):
        raise problem("framework_version", _too_old("is older than smsdp supports"), framework_version)
    known = _listed(version)
    py = _text(py_version) or (known.py_version if known else DEFAULT.py_version)
    if known is not None and py != known.py_version:
        raise problem(
            "py_version",
            f"has no SageMaker PyTorch {version} image (it has {known.py_version}); "
            f"pass py_version='{known.py_version}' or image_uri=",
            py_version,
        )
    return ImageChoice(version, py)


def table_image_uri(choice: ImageChoice, region: str, has_gpus: bool) -> str | None:
    """The image smsdp names for the choice in ``region``; None when its table does not list the version."""
    known = _listed(choice.framework_version or "")
    if known is None:
        return None
    account = DLC_ACCOUNTS.get(region)
    if account is None:
        raise problem(
            "region",
            f"has no SageMaker PyTorch image registry smsdp knows ({', '.join(sorted(DLC_ACCOUNTS))}); "
            f"pass image_uri='<account>.dkr.ecr.{region}.amazonaws.com/{REPOSITORY}:{known.gpu_tag}'",
            region,
        )
    domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{account}.dkr.ecr.{region}.{domain}/{REPOSITORY}:{known.gpu_tag if has_gpus else known.cpu_tag}"


def torch_of_image(image_uri: str) -> str | None:
    """The torch version a DLC or SMP image's tag names (``2.13.0``); None for any other image."""
    match = _IMAGE.match(image_uri)
    if match is None or match["tag"] is None or match["repository"].rsplit("/", 1)[-1] not in _TORCH_TAGGED:
        return None
    if not (match["registry"] == "public.ecr.aws" or ".dkr.ecr." in match["registry"]):
        return None
    found = release(match["tag"])
    return None if found is None else ".".join(map(str, found))


def _listed(version: str) -> PyTorchImage | None:
    return next((image for image in IMAGES if image.framework_version == version), None)


def _full_version(version: str) -> str:
    """``"2.13"`` -> the newest listed 2.13 release (``"2.13.0"``); other versions as given."""
    found = release(version)
    if found is not None and version.count(".") == 1:
        for image in IMAGES:
            if release(image.framework_version)[:2] == found[:2]:
                return image.framework_version
    return version


def _too_old(what: str) -> str:
    return f"{what}: smsdp needs torch {SUPPORTED_RANGE}; " + _HOW_TO_PASS.format(
        default=DEFAULT.framework_version, supported=SUPPORTED_RANGE
    )


def _text(value: object) -> str | None:
    return None if value is None else str(value)
