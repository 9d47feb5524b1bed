"""The text the default model's tokenizer is trained on (common/default_model.py).

Plain English of many kinds (stories, dialogue, instructions, numbers, dates, verse), so the
byte-level BPE learns common words; the bench also draws its prompts' words from it
(bench/workload.py). Changing it changes the tokenizer: bump default_model.py's `_VERSION`.
"""

from __future__ import annotations

CORPUS = """\
The harbor woke slowly. Gulls circled the masts while the fishermen coiled their ropes, and the
smell of salt and diesel drifted over the quay. Maria had run the little cafe by the water for
twenty-three years; she knew every boat by the sound of its engine. "Coffee, black, two sugars,"
she said before old Tomas could open his mouth. He laughed and sat down by the window.

Rain had fallen all night, and the streets were still shining when the first bus came around the
corner. A boy in a yellow coat jumped over a puddle, missed, and splashed his sister, who shrieked
and chased him halfway up the hill. Their mother called after them, but she was smiling.

In the mountains the snow came early that year. The shepherds brought the flocks down from the
high pastures in the second week of October, three weeks sooner than their grandfathers had. The
village held its autumn market anyway: cheese, honey, wool, apples, and bread baked in the stone
oven behind the church. Children ran between the stalls with sticky fingers and red cheeks.

A computer program is a list of instructions that a machine can follow. The instructions are
written in a programming language, such as Python, C, or Rust, and then translated into a form the
processor understands. Good programs are easy to read: their functions are short, their names say
what they mean, and their tests describe how they should behave. When a program fails, the error
message should tell the reader what went wrong and where to look.

A server listens on a network port and answers requests from clients. Each request carries a
method, a path, some headers, and sometimes a body. The server parses the request, does the work,
and sends back a response with a status code: 200 means success, 404 means the resource was not
found, and 500 means something broke inside the server. Timeouts, retries, and back-pressure keep a
busy system from falling over when the traffic grows faster than expected.

Language models read text as a sequence of tokens. A tokenizer splits the text into pieces, maps
each piece to an integer, and the model predicts the next integer, one step at a time. Sampling
with a temperature makes the output more varied; greedy decoding always picks the most likely
token. The attention layers let every position look back at the earlier positions, and a cache of
keys and values saves the work of recomputing them for each new token.

Photosynthesis turns light, water, and carbon dioxide into sugar and oxygen. It happens in the
chloroplasts of plant cells, where a green pigment called chlorophyll absorbs red and blue light
and reflects green. Forests, grasslands, and the tiny plankton of the ocean together produce most
of the oxygen that animals breathe. Without them the air would slowly change, and life would change
with it.

The recipe is simple. Melt two tablespoons of butter in a heavy pan over medium heat. Add one
chopped onion and a pinch of salt, and cook until soft and golden, about ten minutes. Stir in three
cloves of garlic, a teaspoon of smoked paprika, and a can of crushed tomatoes. Let it simmer for
twenty minutes, then taste, adjust the seasoning, and serve over rice or with fresh bread.

"Where are you going?" asked the fox.
"To the river," said the rabbit, "to find my brother. He went fishing yesterday and never came
home."
"Rabbits do not fish," said the fox.
"Mine does," said the rabbit, and she hopped away before the fox could think of an answer.

History is full of small accidents with large results. A letter delivered late, a storm that
scattered a fleet, a wrong turn taken by a driver in a crowded city: each of these changed the
course of nations. Historians argue about how much any single person can shape events, but they
agree that chance plays a larger role than most people like to admit.

Dear Sam,
Thank you for the books you sent last month. I have finished the one about the lighthouse keepers
and started the one about the desert expedition. The weather here has been strange, warm one day
and freezing the next, and the garden does not know what season it is. The tulips came up in
February! Please write soon and tell me how the new job is going.
With love,
Aunt Helen

The museum opens at nine o'clock on weekdays and at ten on weekends. Tickets cost twelve dollars
for adults and five for children under fourteen; students with a valid card pay half price. The
east wing holds paintings from the seventeenth and eighteenth centuries, and the west wing shows
sculpture, pottery, and old maps. Photography without flash is allowed in most rooms.

She counted the stars until she lost track, somewhere after four hundred. The night was clear and
cold, and the milky band of the galaxy stretched from one side of the sky to the other. Far away a
dog barked, and a train whistled twice as it crossed the bridge over the valley. She pulled the
blanket tighter and decided she would stay outside a little longer.

To measure the speed of a falling object, drop it from a known height and time its fall. Near the
surface of the Earth, objects accelerate at about 9.8 meters per second squared, so a stone
dropped from 20 meters reaches the ground in roughly two seconds. Air resistance slows light,
flat objects much more than heavy, round ones, which is why a feather drifts while a marble drops.

The team met every Monday morning to plan the week. First they reviewed what had shipped, then
what had slipped, and finally what was coming next. Questions were welcome; blame was not. When a
release went badly, they wrote down what happened, why it happened, and what they would change, and
they shared the notes with everyone in the company.

Weather report: cloudy in the morning with a chance of light showers, clearing by the afternoon.
Highs near 18 degrees, lows around 9. Winds from the west at 15 to 25 kilometers per hour. Tomorrow
looks sunny and warmer, and the weekend should be dry, although a storm may arrive on Monday night.

Questions and answers
Q: Why is the sky blue?
A: Sunlight scatters off the molecules of the air, and blue light scatters more than red light
because its wavelength is shorter. When you look at any part of the sky away from the sun, you see
that scattered blue light.
Q: Why are sunsets red?
A: At sunset the light travels through much more air to reach you, so most of the blue is
scattered away before it arrives, and the reds and oranges remain.

The old clock in the hall had stopped at a quarter past three, and nobody in the family remembered
when. Grandfather said it was the day the war ended; Grandmother said it was the winter the pipes
froze. The children believed it had simply grown tired of counting, and they liked it better that
way. Every guest who visited asked about it, and every guest heard a different story.

Numbers are everywhere: 1, 2, 3, 10, 42, 100, 256, 1024, 2048, 65536. A year has 365 days, or 366
in a leap year; a day has 24 hours; an hour has 60 minutes. Prices such as $3.99 or 12.50 euros,
dates such as 2024-06-01, and times such as 07:45 all look different, but a good tokenizer learns
to handle each of them.

He opened the door and stepped into the library. The air was quiet and smelled of paper and dust.
Long tables stood in rows under green lamps, and a woman behind the desk looked up, nodded, and went
back to her reading. He found the shelf he wanted, pulled down a heavy atlas, and spread it open on
the nearest table. The map of the northern islands was exactly as he remembered it.

Good writing is mostly rewriting. Say what you mean in plain words, cut what does not help the
reader, and read the result aloud. If a sentence makes you stumble, it will make your reader stumble
too. Short sentences are not always better, but they are rarely worse.

The river rises in the hills, runs through farmland and two small towns, and meets the sea in a wide
estuary full of birds. In spring the water is brown and fast with melted snow; in late summer it is
clear and slow, and you can see the fish resting in the shade under the willows. People have
crossed it by ferry, by ford, and by bridge for more than a thousand years.

The orchestra tuned for a long minute, oboe first, then strings, then brass. When the conductor
raised her baton the hall fell silent, and the first movement began with a single cello, low and
patient, joined one by one by violas, violins, clarinets, and finally the timpani. By the finale
half the audience was leaning forward in their seats, and the applause lasted almost ten minutes.

Astronauts aboard the station exercise for two hours every day, because muscles and bones weaken
quickly in microgravity. They sleep in small cabins, strapped into sleeping bags fixed to the wall,
and they eat tortillas instead of bread, since crumbs would float into delicate equipment. From
orbit they watch sixteen sunrises and sixteen sunsets in every twenty-four hours.

A nurse checked the patient's temperature, pulse, and blood pressure, then wrote the numbers on a
chart at the foot of the bed. The doctor arrived at noon, listened to the lungs, asked about
appetite and sleep, and adjusted the dosage of the antibiotic. "Drink plenty of water," she said,
"and walk around the corridor twice this afternoon if you feel strong enough."

The match was tied at one goal each with five minutes remaining. The visiting striker sprinted down
the left wing, cut inside past two defenders, and curled a shot toward the far post; the goalkeeper
stretched, fingertips brushing leather, and pushed it wide. From the corner kick a tall midfielder
rose above everyone and headed the winner into the net. The stadium exploded with noise.

Volcanoes form where molten rock, called magma, escapes through cracks in the crust. Some erupt
violently, hurling ash and pumice kilometers into the atmosphere; others pour out rivers of lava
that cool into black basalt. Fertile volcanic soil attracts farmers despite the danger, and
geologists monitor tremors, gases, and ground swelling to warn them before an eruption.

Autumn leaves, brittle and bright,
spin in the lantern's amber light;
the wind hums low, the chimney sighs,
and geese write letters across the skies.
"""
