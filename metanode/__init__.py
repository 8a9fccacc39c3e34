"""metanode: a claims-and-CID metadata node for home media boxes."""

__version__ = "0.1.0"
