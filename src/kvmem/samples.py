"""Fixed example text for ``check-exactness`` (no data file needed)."""

SAMPLE_FACTS = [
    "- [8 May, 2023] Caroline attended an LGBTQ support group and found the stories inspiring.\n",
    "- [8 May, 2023] Melanie is managing kids and work and finds it overwhelming.\n",
    "- [25 May, 2023] Melanie painted a lake sunrise last year; it holds special meaning to her.\n",
    "- [9 June, 2023] Caroline is researching adoption agencies and hopes to build a family.\n",
    "- [27 June, 2023] Melanie ran a charity race for mental health on Saturday.\n",
    "- [3 July, 2023] Caroline plans to study counseling and work in mental health.\n",
    "- [6 July, 2023] Melanie took her kids camping in the mountains last week.\n",
    "- [12 July, 2023] Caroline's grandmother gave her a necklace from Sweden.\n",
]
SAMPLE_WINDOW = (
    "Caroline: Hey Mel! Good to see you! How have you been?\n"
    "Melanie: Hey Caroline! I'm swamped with the kids & work. What's up with you?\n"
    "Caroline: I went to an LGBTQ support group yesterday and it was so powerful.\n"
)
SAMPLE_QUESTION = "What did Melanie paint, and when did Caroline go to the support group?"
