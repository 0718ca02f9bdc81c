"""The outcome words, spelled once: a check's, a gate's and a night's (result.json, the history's `outcome`
column, every report). Neutral ground: it imports nothing, so the gate, the result records and the history store
(which never imports the result records) all read the same spelling."""

# A check's or a gate's verdict (a gate: FAIL where any check failed, else INCONCLUSIVE where any check was, else
# PASS); an inconclusive gate exits 0 or 1 as the gate file's `inconclusive:` says.
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
# A check that could not be evaluated (what it compares was not observed): it decides nothing.
SKIPPED = "skipped"
# A night that ended without a verdict (the history's error rows).
ERROR = "error"
