"""The toolkit's shared base, below every room: what each stage needs and none of them owns.

* ``cliargs``: the one command-line convention (``main(argv) -> int``, one-line errors, exit status 2);
* ``cli``: the front door, ``swiftkv COMMAND ...``, which lists and runs every room's commands;
* ``artifacts``: complete-or-absent output folders, atomic JSON, ``provenance.json``;
* ``checkpoint``: the model a user names (a folder or a Hub id), checked before any work;
* ``assets``: the embedded default (SmolLM2-135M-Instruct, ShareGPT) and its one held-out split;
* ``stages``: resumable stages (a finished stage is skipped, a changed one reruns with what follows it).

It imports no room (``swiftkv``, ``kvcompress``, ``distill``, ``eval``) and no heavy library at import time,
so a command parses its arguments and answers ``--help`` without loading torch or transformers.
"""

__version__ = "0.1.0"
