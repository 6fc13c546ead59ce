"""The configuration tree's plumbing: flat keyword options routed to the part that owns each, and a tree's settings
flattened back for JSON (calibration.json, report.json)."""

from dataclasses import fields, is_dataclass


def route_options(options: dict, parts: dict[str, type]) -> tuple[dict[str, dict], dict]:
    """Flat keyword options → one dict per part (by the part's field names) and the rest, for the owner itself.

    Args:
        options: e.g. ``{"seq_len": 128, "observer": "mse", "device": "cpu"}``.
        parts: attribute name → dataclass of a part, e.g. ``{"data": DataConfig, "scales": ScaleConfig}``.
    """
    routed: dict[str, dict] = {name: {} for name in parts}
    rest = dict(options)
    for name, cls in parts.items():
        for f in fields(cls):
            if f.name in rest:
                routed[name][f.name] = rest.pop(f.name)
    return routed, rest


def flat_settings(config: object, order: list[str]) -> dict:
    """The settings of a config tree as one flat dict, in ``order`` (part fields by their own names), for JSON.

    calibration.json and verify's report.json keep the flat layout they always had, so runs stay comparable.
    """
    values = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):  # a part: its fields under their own names
            values.update({g.name: getattr(value, g.name) for g in fields(value)})
        else:
            values[f.name] = value
    return {name: values[name] for name in order}
