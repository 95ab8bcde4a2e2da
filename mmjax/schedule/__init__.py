"""Pipeline schedules as data, in pure Python: the stage graph, the schedules, their
dependency check and the 1F1B timing model. Below the planner and the data reorderer, which
read them; the pipeline runtime walks them."""
