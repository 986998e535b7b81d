"""The five collectives: their primitives (spec, driver, rules, lowering), auto's decision, and error feedback."""
