"""The fork server's first preload (qual.runtime.launch): importing this module arms the server to die with its parent.

The server's parent is the driver that started it. Its rank processes die with the server (their own parent-death
signal), so a driver killed with -9 takes the server and every rank along. The ranks hold the write end of the
server's "alive" pipe too (multiprocessing hands it to every child), so without this the server would wait for
them and they for it. Should the driver die before this runs, no rank exists yet: the pipe's end-of-file then
stops the server once its preloads are done. Nothing but the fork server imports this module.
"""

from __future__ import annotations

import os

from qual.proc import die_with_parent

die_with_parent(os.getppid())
