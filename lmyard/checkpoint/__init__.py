"""One checkpoint API: the formats (full state dict, DCP), the manifest written last, the catalog and retention."""
