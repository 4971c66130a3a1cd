"""Reproductions of papers' released code, one subpackage per paper, named after the paper.

countlens has its own methods (`countlens.analysis`, `countlens.circuits`, `countlens.datasets`,
`countlens.training`), written from the papers' text. Where a paper's *released code* computes
something differently from its text — another benchmark generator, another parser, another formula,
another probe — and its published numbers come from that code, the code's way is reproduced here so
the numbers can be compared, and countlens's own way stays where it was. "Reference" is that released
code: what is here says, module by module, which file of which repository it follows and where it
departs (and why). Nothing here is imported at ``import countlens``; countlens's own modules reach a
reproduction only where a setting asks for it (``design="paper-code"``, ``parser="paper-code"``,
``recipe="counting-to-four"``, ``attention_at="generation"``).

- `countlens.reference.counting_to_four`: the MAS paper ("Counting to Four", leduy99/-CVPRW26-Modality-
  Attention-Share): its COUNTINGTRICKS generator, its answer parser, its attention diagnostics and its
  detection probes.
"""
