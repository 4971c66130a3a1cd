"""The report's figures, one module per kind of picture; `countlens.analysis.plots` names them all.

- `canvas`: what every figure shares: a matplotlib ``Figure`` made without pyplot (no global state,
  no display), a title that is wrapped until it fits inside the image, thinned tick labels, and text
  that stays readable on any cell colour.
- `grids`: layer × head maps (a measurement with a colour bar, or the head classes in categorical
  colours) and small labelled matrices (the tasks' Jaccard overlaps).
- `curves`: quantities along the layers or along a circuit's size (VAP, the logit lens, the layer at
  which the answer becomes rank 1, faithfulness) and the AtP-vs-exact scatter.
- `depth`: several models on one relative-depth axis (`countlens compare`): the VAP hand-off curves
  and the head classes per depth bin.
- `counting`: COUNTINGTRICKS accuracy (per case as bars and in the paper's Table 5 layout, by the
  true count), the attention share by modality for right and wrong answers, and the probes' AP@50.
- `objects`: which objects the model counts (discover's ``objects`` stage): scenes with each object
  outlined in the colour of its effect, right answers above wrong ones, and the effect against the
  object's offset from the nearest cell centre.

Each picture has a builder that returns the drawn ``Figure`` (tests read its texts, images and title
back) and a ``plot_*`` function that saves it as a PNG and returns the path.
"""
