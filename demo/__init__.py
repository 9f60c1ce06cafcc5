"""Demos: a worker serving the bundled models, driven end to end through Kafka by the SDK.

A demo is a client of a worker: it starts one as a child process (``worker``) and
talks to it through ``producers``, the way any client does.

- ``python -m demo.digits`` (``make demo``): serve the digits classifier and score
  it on its held-out digits;
- ``python -m demo.video`` (``make demo-video``): stream a video of moving digits
  through the demo detector and read the boxes back in frame order.

The models are in ``demo.models``; training them needs the ``demo`` extra
(scikit-learn).
"""
