"""One file per target layer kind, each a registered `LayerKind` (opd/models/layer_kind.py): every module here is
imported when a target's layers are first mapped to their kinds, so adding a kind is adding a file."""
