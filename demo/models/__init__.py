"""The demo's models, trained here in seconds on data that ships with scikit-learn.

The worker loads them as it loads any handler class of a user's (``module:Class``,
docs/models.md), so ``workers`` never imports this package:

- ``digits``: ``DigitsClassifier``, a small CNN for 8x8 digits (``--model digits``);
- ``detector``: ``DigitsDetector``, a small CenterNet (``centernet``) that finds digits on
  a canvas, trained on the scenes of ``scenes``.
"""
