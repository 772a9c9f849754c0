"""The demo's built-in corpus and queries: a few topics, so that a semantic search has
something to find, with some non-ASCII text among them."""

from __future__ import annotations

CORPUS: tuple[str, ...] = (
    # food
    "A man is eating a piece of bread.",
    "The chef is slicing onions for the soup.",
    "Fresh pasta tastes best with a little olive oil and basil.",
    "She baked a chocolate cake for her daughter's birthday.",
    "Le croissant était encore chaud quand je l'ai acheté ce matin.",
    # animals
    "A cheetah is running behind its prey across the savanna.",
    "The cat sleeps on the windowsill in the afternoon sun.",
    "A dog is fetching a stick from the lake.",
    "Monkeys are climbing the trees in the rainforest.",
    # music
    "A man is playing the guitar on a street corner.",
    "The orchestra rehearsed Beethoven's ninth symphony all week.",
    "She practises the piano for an hour every evening.",
    "Die Band spielte bis spät in die Nacht.",
    # computing
    "The controller sends the same call to every worker process.",
    "Tensor parallelism splits each weight matrix across several devices.",
    "The database query was slow because the table had no index.",
    "He rewrote the parser in Rust and it became ten times faster.",
    "Garbage collection paused the server for two hundred milliseconds.",
    # travel and weather
    "The train to Kyoto leaves at seven in the morning.",
    "東京は今日は晴れて暖かいです。",
    "Heavy rain is expected over the mountains this weekend.",
    "We hiked to the summit and watched the sunrise above the clouds.",
    "El vuelo a Madrid se retrasó dos horas por la niebla.",
    # sport
    "The goalkeeper saved a penalty in the last minute of the match.",
    "She ran the marathon in under three hours.",
    "The cyclists climbed the mountain pass in the Tour de France.",
    # health and science
    "Regular exercise lowers the risk of heart disease.",
    "The telescope captured light from a galaxy billions of years old.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "Vaccines train the immune system to recognise a virus.",
    # money
    "The central bank raised interest rates by a quarter of a point.",
    "Shares of the company fell after the disappointing earnings report.",
    "He saves a tenth of his salary every month.",
)

QUERIES: tuple[str, ...] = (
    "Someone is having a meal.",
    "An animal is chasing another animal.",
    "How do I make my program run faster?",
    "What will the weather be like?",
    "Musik und Konzerte",
    "Is the stock market going down?",
)
