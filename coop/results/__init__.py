"""The results layer: what finished runs say, as tables and figures, beside the published ones.

tables.py (tables from run folders), markdown.py (the tables as Markdown), run_files.py (reading
run folders), base_to_new.py (the base-to-new table), tta_table.py (the test-time table), published.py (published figures with their
sources), reproduce.py (paper and Δ rows beside ours), plots.py (figures), recipe_table.py (the
resolved recipes as tables), model_table.py (the support matrix of open_clip's models), and the
analysis of learned prompts: nearest_words.py and attention_maps.py.

Beside coop.train (neither imports the other: these modules read the files a run wrote). May
import: coop.methods, coop.model, coop.data, coop.config and the root modules. Imported by: the
tools.
"""
