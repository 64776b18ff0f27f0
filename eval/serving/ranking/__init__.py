"""Learning to rank output lengths for shortest-job-first serving (``swiftkv ranking``).

Stages, each a function with a thin CLI: :mod:`.traces` (prompt, reply length) pairs from the target model;
:mod:`.train` ListMLE (or bucket-classification) training of a predictor from :mod:`.predictors` — a small
separate LM, or a head on the served model's SwiftKV-layer input x_l; :mod:`.simulator` an iteration-level
scheduler that orders requests with the 3-pivot quicksort of :mod:`.multipivot`.  Nothing heavy is
imported here.
"""
