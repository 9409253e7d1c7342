"""The media flags of `serve` and `generate`, vLLM's: where a prompt's images may come from
(`--allowed_media_domains`, `--allowed_local_media_path`) and how many it may hold
(`--limit_mm_per_prompt`). absl checks each as it parses it (exit 2 naming the flag)."""
from __future__ import annotations

from absl import flags

from jaxserve.multimodal.media import MediaPolicy, parse_limit_mm_per_prompt
from serve.images import MediaSettings


def define_media_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("limit_mm_per_prompt", None, "JSON object of how many items of each modality one prompt may "
                        "hold, e.g. '{\"image\": 4}' (vLLM's flag; default 999 of each; images are the one "
                        "modality served)", flag_values=fv)
    flags.register_validator("limit_mm_per_prompt", _checked(parse_limit_mm_per_prompt), flag_values=fv)
    flags.DEFINE_list("allowed_media_domains", None, "hosts (comma-separated) whose http(s) image URLs may be "
                      "fetched; a loopback or private address only when listed as that address (127.0.0.1) or "
                      "localhost. Default: none, images come as data: URLs (or files, --allowed_local_media_path)",
                      flag_values=fv)
    flags.DEFINE_string("allowed_local_media_path", None, "a folder under which file:// image URLs may be read "
                        "(symlinks resolved first). Default: no files", flag_values=fv)
    flags.register_validator("allowed_local_media_path",
                             _checked(lambda path: MediaPolicy.from_flags(allowed_local_media_path=path)),
                             flag_values=fv)


def _checked(parse):
    def check(value) -> bool:
        try:
            parse(value)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True
    return check


def media_settings(fv: flags.FlagValues) -> MediaSettings:
    """The media flags' values as the server and `generate` use them."""
    return MediaSettings(MediaPolicy.from_flags(fv.allowed_media_domains, fv.allowed_local_media_path),
                         parse_limit_mm_per_prompt(fv.limit_mm_per_prompt))
