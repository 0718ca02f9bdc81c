"""`qual run`: plan two arms, replay the corpus through both, compare, gate, report, record."""
