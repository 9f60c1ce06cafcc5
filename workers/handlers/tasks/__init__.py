"""Handlers for the tasks beyond classification: detection, instance segmentation and
keypoints (``detection``), semantic segmentation (``segmentation``) and embeddings
(``embedding``), with what they share: request parameters (``params``), COCO RLE masks
(``rle``) and running a list of variable-size images in same-shape groups (``groups``).

Their result shapes are ``schemas.outputs``; docs/models.md describes both.
"""
