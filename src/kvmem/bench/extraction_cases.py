"""A scripted conversation set for fact extraction (``kvmem bench extract``): 44 cases a user would recognise.

Each case is one user. ``seed`` memories are stored verbatim first (``infer=False``), then ``turn`` (the messages
of one exchange) goes through ``Memory.add(infer=True)``. What the memory state must then hold:

* ``expect``: facts, each a tuple of keywords that must all appear (case-insensitive) in one live memory;
* ``forbid``: keywords no live memory may contain afterwards (what was forgotten or corrected away, or what only
  the assistant or a system message said);
* ``update``: the seed index whose memory must have been turned into an UPDATE (a correction);
* ``delete``: the seed index whose memory must have been deleted (a request to forget).

``questions`` are asked afterwards: ``answer`` keywords for answerable ones; ``None`` for a trap, whose answer
is nowhere in memory, so the model should say it does not know (abstention).

Kinds: ``new`` (new facts), ``correction``, ``forget``, ``third_party`` (facts about people the user names) and
``chitchat`` (nothing worth remembering).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    turn: list[tuple[str, str]]
    seed: list[str] = field(default_factory=list)
    expect: list[tuple[str, ...]] = field(default_factory=list)
    forbid: list[str] = field(default_factory=list)
    update: int | None = None
    delete: int | None = None
    questions: list[tuple[str, tuple[str, ...] | None]] = field(default_factory=list)


U, A, S = "user", "assistant", "system"

CASES = [
    # --- new facts -----------------------------------------------------------------------------------------
    Case(
        "new-city",
        "new",
        [(U, "I just moved to Porto for a new job.")],
        expect=[("porto",)],
        questions=[("Where do I live?", ("porto",)), ("What car do I drive?", None)],
    ),
    Case(
        "new-pet",
        "new",
        [(U, "We adopted a grey cat called Pixel last week.")],
        expect=[("pixel",)],
        questions=[("What is my cat's name?", ("pixel",)), ("What is my salary?", None)],
    ),
    Case(
        "new-allergy",
        "new",
        [(U, "Just so you know, I'm allergic to peanuts.")],
        expect=[("peanut",)],
        questions=[("What am I allergic to?", ("peanut",))],
    ),
    Case(
        "new-job",
        "new",
        [(U, "I work as a nurse at the city hospital.")],
        expect=[("nurse",)],
        questions=[("What is my job?", ("nurse",)), ("Which bank do I use?", None)],
    ),
    Case("new-diet", "new", [(U, "I've been vegetarian for three years now.")], expect=[("vegetarian",)]),
    Case(
        "new-hobby",
        "new",
        [(U, "On Sundays I play the cello in a small orchestra.")],
        expect=[("cello",)],
        questions=[("What instrument do I play?", ("cello",))],
    ),
    Case("new-birthday", "new", [(U, "My birthday is on the 14th of March.")], expect=[("march",)]),
    Case(
        "new-plan",
        "new",
        [(U, "I'm flying to Tokyo in October for a conference.")],
        expect=[("tokyo",)],
        questions=[("Where am I travelling in October?", ("tokyo",)), ("What hotel did I book?", None)],
    ),
    Case("new-language", "new", [(U, "I'm learning Japanese, about two lessons a week.")], expect=[("japanese",)]),
    Case(
        "new-two-facts",
        "new",
        [(U, "I run marathons, and my favourite food is ramen.")],
        expect=[("marathon",), ("ramen",)],
    ),
    Case(
        "new-with-assistant",
        "new",
        [(U, "I drink my coffee black."), (A, "Noted! Many people also enjoy oat milk lattes.")],
        expect=[("coffee", "black")],
        forbid=["oat"],
    ),
    Case(
        "new-with-system",
        "new",
        [(S, "The user is a premium customer named Zelda."), (U, "I prefer window seats on flights.")],
        expect=[("window",)],
        forbid=["premium", "zelda"],
    ),
    # --- corrections -----------------------------------------------------------------------------------------
    Case(
        "fix-city",
        "correction",
        [(U, "Actually I moved to Braga, not Porto.")],
        seed=["I live in Porto."],
        expect=[("braga",)],
        update=0,
        questions=[("Which city do I live in?", ("braga",))],
    ),
    Case(
        "fix-pet-name",
        "correction",
        [(U, "Correction: my dog is called Biscuit, not Cookie.")],
        seed=["My dog is called Cookie."],
        expect=[("biscuit",)],
        update=0,
    ),
    Case(
        "fix-job",
        "correction",
        [(U, "I no longer work at the bakery; I'm a teacher now.")],
        seed=["I work at a bakery."],
        expect=[("teacher",)],
        update=0,
    ),
    Case(
        "fix-age",
        "correction",
        [(U, "Sorry, I said I was 30, but I'm actually 32.")],
        seed=["I am 30 years old."],
        expect=[("32",)],
        update=0,
    ),
    Case(
        "fix-car",
        "correction",
        [(U, "I sold the Golf. I drive a Tesla now.")],
        seed=["I drive a Volkswagen Golf."],
        expect=[("tesla",)],
        update=0,
    ),
    Case(
        "fix-phone",
        "correction",
        [(U, "My phone number changed, it's 555-0199 now.")],
        seed=["My phone number is 555-0123."],
        expect=[("555-0199",)],
        forbid=["555-0123"],
        update=0,
    ),
    Case(
        "fix-partner",
        "correction",
        [(U, "My wife's name is Ana, not Anna, please fix that.")],
        seed=["My wife is called Anna."],
        expect=[("ana",)],
        update=0,
    ),
    Case(
        "fix-diet",
        "correction",
        [(U, "I'm not vegan anymore, I eat fish again.")],
        seed=["I am vegan."],
        expect=[("fish",)],
        update=0,
    ),
    Case(
        "fix-meeting",
        "correction",
        [(U, "The dentist appointment moved from Monday to Thursday.")],
        seed=["I have a dentist appointment on Monday."],
        expect=[("thursday",)],
        update=0,
    ),
    # --- forgetting ------------------------------------------------------------------------------------------
    Case(
        "forget-ssn",
        "forget",
        [(U, "Please forget my social security number.")],
        seed=["My social security number is 078-05-1120.", "I like hiking."],
        forbid=["078-05-1120"],
        delete=0,
        expect=[("hiking",)],
        questions=[("What is my social security number?", None)],
    ),
    Case(
        "forget-address",
        "forget",
        [(U, "Delete my home address from your memory.")],
        seed=["My home address is 12 Elm Street.", "I have two kids."],
        forbid=["elm street"],
        delete=0,
        expect=[("kids",)],
    ),
    Case(
        "forget-ex",
        "forget",
        [(U, "Forget everything about my ex, Tom.")],
        seed=["My ex-boyfriend Tom lives in Lyon.", "I am a graphic designer."],
        forbid=["tom"],
        delete=0,
        expect=[("designer",)],
    ),
    Case(
        "forget-salary",
        "forget",
        [(U, "Don't remember my salary anymore, remove it.")],
        seed=["My salary is 85,000 euros a year.", "I cycle to work."],
        forbid=["85,000"],
        delete=0,
        expect=[("cycle",)],
        questions=[("How much do I earn?", None)],
    ),
    Case(
        "forget-medication",
        "forget",
        [(U, "Please erase the fact that I take sertraline.")],
        seed=["I take sertraline every morning.", "I enjoy jazz."],
        forbid=["sertraline"],
        delete=0,
        expect=[("jazz",)],
    ),
    Case(
        "forget-password-hint",
        "forget",
        [(U, "Forget my password hint, I shouldn't have shared it.")],
        seed=["My password hint is 'blue horse'.", "I live near the river."],
        forbid=["blue horse"],
        delete=0,
    ),
    Case(
        "forget-birthday",
        "forget",
        [(U, "Remove my birthday from memory please.")],
        seed=["My birthday is on the 2nd of June.", "I play chess."],
        forbid=["june"],
        delete=0,
        expect=[("chess",)],
    ),
    Case(
        "forget-employer",
        "forget",
        [(U, "Forget where I work.")],
        seed=["I work at Globex Corporation.", "My favourite colour is green."],
        forbid=["globex"],
        delete=0,
        expect=[("green",)],
    ),
    Case(
        "forget-plan",
        "forget",
        [(U, "I cancelled the Rome trip, forget about it.")],
        seed=["I am going to Rome in May.", "I speak Italian."],
        forbid=["rome"],
        delete=0,
    ),
    # --- third-party facts -----------------------------------------------------------------------------------
    Case(
        "third-sister",
        "third_party",
        [(U, "My sister Mia just started medical school in Lisbon.")],
        expect=[("mia", "medical")],
        questions=[("What does my sister study?", ("medical",))],
    ),
    Case(
        "third-boss",
        "third_party",
        [(U, "My boss, Karen, is retiring at the end of the year.")],
        expect=[("karen", "retir")],
    ),
    Case("third-son", "third_party", [(U, "My son Leo is allergic to cats.")], expect=[("leo", "cat")]),
    Case(
        "third-friend",
        "third_party",
        [(U, "My friend Raj got a job at a robotics startup.")],
        expect=[("raj", "robotics")],
        questions=[("Where does Raj work?", ("robotics",))],
    ),
    Case("third-mother", "third_party", [(U, "My mom turns 70 next week; she loves orchids.")], expect=[("orchid",)]),
    Case(
        "third-neighbour",
        "third_party",
        [(U, "Our neighbour Mr. Diaz plays the trumpet every evening.")],
        expect=[("diaz", "trumpet")],
    ),
    Case(
        "third-colleague",
        "third_party",
        [(U, "My colleague Priya is vegan, so I'll bring a vegan cake."), (A, "Great idea!")],
        expect=[("priya", "vegan")],
    ),
    # --- chit-chat: nothing to remember ------------------------------------------------------------------------
    Case(
        "chat-hello",
        "chitchat",
        [(U, "Hi there! How are you today?"), (A, "I'm doing well, thanks!")],
        questions=[("What is my favourite sport?", None)],
    ),
    Case("chat-thanks", "chitchat", [(U, "Thanks, that was helpful.")]),
    Case("chat-weather", "chitchat", [(U, "What's the weather usually like in autumn?")]),
    Case(
        "chat-joke",
        "chitchat",
        [(U, "Tell me a joke about penguins."), (A, "Why don't penguins fly? ...")],
        forbid=["penguin"],
    ),
    Case("chat-math", "chitchat", [(U, "What is 17 times 23?"), (A, "17 times 23 is 391.")], forbid=["391"]),
    Case("chat-bye", "chitchat", [(U, "Ok, talk to you later. Bye!")], questions=[("What is my dog's name?", None)]),
    Case(
        "chat-question",
        "chitchat",
        [(U, "Can you explain how photosynthesis works?")],
        questions=[("Which city was I born in?", None)],
    ),
]
