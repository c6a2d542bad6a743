"""`cisjax sweep`: correction arms x seeds as ordinary train runs, then one comparison (sweep.md, plots)."""
