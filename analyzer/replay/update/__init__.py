"""Update forensics: which factor of the optimizer's update made weights NaN/Inf, and the replay's result from it."""
